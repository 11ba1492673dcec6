#!/usr/bin/env python3
"""The A/B table of tools/gpu/ab_decode.sh: each decode_bench row's time and each `vt bench` run's
TPOT and median step (and its prefill rate, from tools/gpu/ab_prefill.sh), the median over rounds
for side A and side B, and B / A (below 1: B is faster in time; above 1: B is faster in tok/s).

Lines of the input are `A | <decode_bench row>` or `A | e2e <config> | <vt bench batch line>`.

usage: ab_table.py ab.txt
"""
import re
import statistics
import sys


def samples(path):
    """{measure name: {"A": [values], "B": [values]}} in first-seen order, and each measure's unit."""
    found, units = {}, {}

    def add(name, side, value, unit):
        found.setdefault(name, {"A": [], "B": []})[side].append(value)
        units[name] = unit

    for line in open(path):
        side, _, rest = line.rstrip("\n").partition(" | ")
        if side not in ("A", "B"):
            continue
        if rest.startswith("e2e "):
            config, _, run = rest[4:].partition(" | ")
            batch = re.match(r"batch\s+(\d+)", run)
            for what, pattern, unit in (
                ("TPOT", r"TPOT\s+([\d.]+) ms", "ms"),
                ("median step", r"median step ([\d.]+) ms", "ms"),
                ("prefill", r"prefill\s+([\d.]+) tok/s", "tok/s"),
            ):
                m = re.search(pattern, run)
                if m:
                    add(f"e2e {config} b{batch.group(1) if batch else '?'} {what}", side, float(m.group(1)), unit)
        else:
            m = re.match(r"(.*?)\s+([\d.]+) µs", rest)
            if m:
                add(m.group(1), side, float(m.group(2)), "µs")
    return found, units


def main():
    found, units = samples(sys.argv[1])
    if not found:
        sys.exit(f"{sys.argv[1]}: no A/B rows (did the binaries run? see the logs beside it)")
    print(f"{'measure':<56} {'A':>10} {'B':>10} {'B / A':>7}   rounds")
    for name, sides in found.items():
        if not sides["A"] or not sides["B"]:
            print(f"{name:<56} one side only: A {sides['A']} B {sides['B']}")
            continue
        a, b = statistics.median(sides["A"]), statistics.median(sides["B"])
        unit = units[name]
        print(f"{name:<56} {a:>7.2f} {unit} {b:>7.2f} {unit} {b / a:>7.3f}   {len(sides['A'])} / {len(sides['B'])}")


if __name__ == "__main__":
    main()
