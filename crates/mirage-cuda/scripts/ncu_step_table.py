#!/usr/bin/env python3
"""Per-kernel table of one decode step from an ncu CSV.

Usage: ncu_step_table.py NCU_CSV [STEP [FIRST]]

NCU_CSV is what `ncu --metrics gpu__time_duration.sum --csv --log-file F
mirage-cli bench ...` writes (h200-pdl.sh makes one). Every forward pass
starts with an `embed_*` kernel, so the kernels between two of them are one
step; STEP picks which (default -1: the last, a decode step). Prints, per
kernel name, launches, total and mean duration and share of the step, then
the sum, then the first FIRST launches of the step in order (default 12:
the embedding and the first layers, which tells apart launches of one
kernel that do different jobs, e.g. Q/K/V vs O vs down). ncu runs kernels one at a time, so the sum is the work of the step
without the gaps between kernels; compare it with the step's wall time from
the bench to see what the gaps cost.
"""
import csv
import sys
from collections import OrderedDict


def rows(path):
    with open(path, newline="") as f:
        # ncu prints its own log lines before the CSV header.
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        us = v / 1e3 if unit.startswith("n") else v if unit.startswith("u") else v * 1e3
        yield r["Kernel Name"].split("(")[0], us


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    step = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    first = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    steps, cur = [], []
    for name, us in rows(sys.argv[1]):
        if name.startswith("embed_") and cur:
            steps.append(cur)
            cur = []
        cur.append((name, us))
    if cur:
        steps.append(cur)
    if not steps:
        sys.exit("no gpu__time_duration rows in " + sys.argv[1])
    s = steps[step]
    total = sum(us for _, us in s)
    agg = OrderedDict()
    for name, us in s:
        n, t = agg.get(name, (0, 0.0))
        agg[name] = (n + 1, t + us)
    print(f"step {step} of {len(steps)}: {len(s)} kernels, {total:.1f} us of kernel time")
    print(f"{'kernel':<34} {'launches':>8} {'total us':>9} {'mean us':>8} {'share':>6}")
    for name, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<34} {n:>8} {t:>9.1f} {t / n:>8.2f} {100 * t / total:>5.1f}%")
    if first > 0:
        print(f"first {min(first, len(s))} launches: " + ", ".join(f"{name} {us:.1f}" for name, us in s[:first]))


if __name__ == "__main__":
    main()
