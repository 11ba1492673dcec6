#!/usr/bin/env python3
"""Per-kernel times of one decode step from an ncu CSV (tools/gpu/profile_decode.sh writes it):
each kernel of the last step in launch order, then the step's kernels summed by name.

ncu runs every kernel alone (no overlap between launches), so the step's sum is what the step would
take without programmatic dependent launch; set it beside `vt bench`'s TPOT to see how much the
overlap wins, and read the table for where the time goes.

usage: decode_profile.py ncu.csv
"""
import collections
import csv
import sys


def kernels(path):
    """(name, grid, block, µs) of every profiled kernel, in launch order."""
    lines = open(path).read().splitlines()
    header = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if header is None:
        sys.exit(f"{path}: no ncu CSV table (did ncu run? see its stderr)")
    rows = []
    for r in csv.DictReader(lines[header:]):
        if r["Metric Name"] != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[r["Metric Unit"]]
        rows.append((r["Kernel Name"], r["Grid Size"], r["Block Size"], float(r["Metric Value"].replace(",", "")) * scale))
    return rows


def last_step(rows):
    """The kernels from the last `embedding` launch on: the last decode step."""
    starts = [i for i, r in enumerate(rows) if r[0] == "embedding"]
    if not starts:
        sys.exit("no `embedding` kernel: not a profile of vt's decode")
    return rows[starts[-1]:]


def main():
    step = last_step(kernels(sys.argv[1]))
    total = sum(r[3] for r in step)
    print(f"last decode step: {len(step)} kernels, {total:.1f} µs summed (each kernel alone)")
    for name, grid, block, us in step:
        print(f"  {us:8.2f} µs  {name[:48]:<48} grid {grid:>16} block {block}")
    print("by kernel:")
    by = collections.defaultdict(lambda: [0, 0.0])
    for name, _, _, us in step:
        by[name][0] += 1
        by[name][1] += us
    for name, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"  {us:8.1f} µs {100 * us / total:5.1f} %  {n:3d} x {us / n:7.2f} µs  {name[:60]}")


if __name__ == "__main__":
    main()
