#!/usr/bin/env python3
"""Where a recorded decode step's time goes, from tools/gpu/kernel_trace.c's CSV (trace_decode.sh).

A step is the span from one `cuGraphLaunch` to the next. For each step: its wall time, how long
the first kernel started after the host's launch call, how long the GPU sat idle after the step's
last kernel, and how much of that idle time passed before the host called the next launch (the
picks read back and the next step prepared: what launching the next step ahead of the readback
could hide; the launch call itself is slower under CUPTI), and the kernels' busy time. For the median step, each kernel in start order with its own span and its increment: how far
it moved the step's end (its end less the latest end before it), which is what removing or
shortening it could save on a chain of dependent launches. Then the increments summed by kernel.

usage: kernel_trace.py trace.csv [--kernels]
"""
import bisect
import collections
import statistics
import sys


def load(path):
    kernels, calls = [], []
    for line in open(path):
        parts = line.rstrip("\n").split(",", 8)
        if parts[0] == "K" and len(parts) == 9:
            start, end = int(parts[1]), int(parts[2])
            grid = "x".join(parts[4:7])
            kernels.append((start, end, int(parts[3]), grid, int(parts[7]), parts[8]))
        elif parts[0] == "D" and len(parts) >= 4:
            calls.append((int(parts[1]), int(parts[2]), parts[3]))
    kernels.sort()
    calls.sort()
    return kernels, calls


def short(name):
    """The kernel's name without template arguments and parameters."""
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name


def between(items, start, end):
    """The records (sorted by start) that start in [start, end)."""
    return items[bisect.bisect_left(items, (start,)):bisect.bisect_left(items, (end,))]


def steps(kernels, calls):
    """(launch call, next launch call, kernels, calls) of each step: from one graph launch to the next."""
    launches = [c for c in calls if c[2].startswith("cuGraphLaunch")]
    out = []
    for a, b in zip(launches, launches[1:]):
        ks = between(kernels, a[0], b[0])
        if ks:
            out.append((a, b, ks, between(calls, a[0], b[0])))
    return out


def busy(ks):
    total, reach = 0, None
    for s, e, *_ in ks:
        if reach is None or s > reach:
            total += e - s
            reach = e
        elif e > reach:
            total += e - reach
            reach = e
    return total


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    kernels, calls = load(sys.argv[1])
    all_steps = steps(kernels, calls)
    if not all_steps:
        sys.exit(f"{sys.argv[1]}: no two graph launches with kernels between them (a recorded decode?)")
    rows = []
    for i, (a, b, ks, cs) in enumerate(all_steps):
        wall = b[0] - a[0]
        first, last = ks[0][0], max(k[1] for k in ks)
        nxt = all_steps[i + 1][2][0][0] if i + 1 < len(all_steps) else None
        idle = (nxt - last) if nxt is not None else None
        rows.append((wall, first - a[0], last - first, busy(ks), idle, len(ks), i, b[0] - last))
    us = lambda ns: ns / 1e3
    walls = [r[0] for r in rows]
    print(f"{len(rows)} steps; wall median {us(statistics.median(walls)):.1f} µs")
    for label, col in (("launch call -> first kernel", 1), ("first kernel -> last end (GPU span)", 2),
                       ("kernels busy (union)", 3), ("GPU idle after the step", 4),
                       ("last kernel end -> next launch call", 7)):
        vals = [r[col] for r in rows if r[col] is not None]
        print(f"  {label:<38} median {us(statistics.median(vals)):8.1f} µs  min {us(min(vals)):8.1f}  max {us(max(vals)):8.1f}")
    med = sorted(rows, key=lambda r: r[0])[len(rows) // 2]
    a, b, ks, cs = all_steps[med[6]]
    print(f"median step #{med[6]}: wall {us(med[0]):.1f} µs, {med[5]} kernels, GPU span {us(med[2]):.1f} µs")
    by = collections.defaultdict(lambda: [0, 0, 0])
    reach = ks[0][0]
    listing = []
    for s, e, graph, grid, block, name in ks:
        inc = max(0, e - reach)
        gap = s - reach
        reach = max(reach, e)
        n = short(name)
        by[n][0] += 1
        by[n][1] += inc
        by[n][2] += e - s
        listing.append(f"  {us(s - ks[0][0]):9.2f} {us(e - s):8.2f} {us(inc):8.2f} {us(gap):8.2f}  {n[:44]:<44} {grid} x {block}")
    if "--kernels" in sys.argv:
        print("  start µs   span µs  incr µs   gap µs  kernel")
        print("\n".join(listing))
    span = sum(v[1] for v in by.values())
    print("increments by kernel (what each moved the step's end):")
    for n, (count, inc, own) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"  {us(inc):8.1f} µs {100 * inc / span:5.1f} %  {count:3d} x {us(inc) / count:6.2f} µs  (own span {us(own) / count:6.2f})  {n[:56]}")
    print("driver calls in the median step (host):")
    calls_by = collections.defaultdict(lambda: [0, 0])
    for s, e, n in cs:
        calls_by[n][0] += 1
        calls_by[n][1] += e - s
    for n, (count, t) in sorted(calls_by.items(), key=lambda kv: -kv[1][1]):
        print(f"  {us(t):8.1f} µs  {count:4d} x  {n}")


if __name__ == "__main__":
    main()
