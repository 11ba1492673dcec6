#!/usr/bin/env python3
"""Where a kernel's warps wait, from ncu's source view (tools/gpu/profile_kernels.sh writes it with
`ncu --import R --page source --csv --print-source sass`), for each profiled kernel:

- the warp-state samples summed by stall reason (long_sb: a global or local load; short_sb: shared
  memory; wait: a fixed-latency dependency; barrier; ...);
- the instructions with the most samples, each with its execution count and top reasons;
- the code grouped by execution count: instructions executed N times are one path run N times
  (N = warps x iterations), so "exec 4608 x 1100 instrs" reads as a 1100-instruction path that 4608
  warp-visits took. This is how the fused MoE decode experiment's 69 instructions per 16-byte chunk
  showed up (closing note of 2026-11-29, ninth session).

usage: kernel_stalls.py source.csv [TOP]
"""
import collections
import csv
import sys


def kernels(path):
    """(name, header, rows) per kernel of the CSV: each starts with a "Kernel Name" line."""
    lines = open(path).read().splitlines()
    starts = [i for i, l in enumerate(lines) if l.startswith('"Kernel Name"')]
    if not starts:
        sys.exit(f"{path}: no ncu source table (did the import run? see its stderr)")
    out = []
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        name = next(csv.reader([lines[a]]))[1]
        table = list(csv.reader(lines[a + 1 : b]))
        header, rows = table[0], [r for r in table[1:] if len(r) == len(table[0])]
        out.append((name, header, rows))
    return out


def report(name, header, rows, top):
    col = {h: i for i, h in enumerate(header)}
    samples, executed = col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    reasons = [(h[len("stall_") :], i) for h, i in col.items() if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, i: int(r[i]) if r[i] not in ("", "-") else 0
    total = sum(num(r, samples) for r in rows) or 1
    print(f"== {name}: {total} samples, {sum(num(r, executed) for r in rows)} warp instructions executed, "
          f"{len(rows)} in the binary")
    by_reason = collections.Counter()
    for r in rows:
        for reason, i in reasons:
            by_reason[reason] += num(r, i)
    print("   stalls: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in by_reason.most_common(8) if v))
    print("   instructions with the most samples (address, samples, executions, SASS, top reasons):")
    for r in sorted(rows, key=lambda r: -num(r, samples))[:top]:
        why = sorted(((num(r, i), k) for k, i in reasons if num(r, i)), reverse=True)[:3]
        print(f"   {r[0][-6:]} {num(r, samples):6d} {num(r, executed):8d}  {r[1].strip()[:56]:56s} "
              + ", ".join(f"{k} {n}" for n, k in why))
    groups, group_samples = collections.Counter(), collections.Counter()
    for r in rows:
        groups[num(r, executed)] += 1
        group_samples[num(r, executed)] += num(r, samples)
    all_exec = sum(n * c for n, c in groups.items()) or 1
    print("   paths by execution count (executions x instructions: share of executed, of samples):")
    for n, c in sorted(groups.items(), key=lambda x: -x[0] * x[1])[:top // 2]:
        print(f"   exec {n:8d} x {c:5d} instrs: {100 * n * c / all_exec:5.1f}% executed, "
              f"{100 * group_samples[n] / total:5.1f}% samples")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    for name, header, rows in kernels(sys.argv[1]):
        report(name, header, rows, top)


if __name__ == "__main__":
    main()
