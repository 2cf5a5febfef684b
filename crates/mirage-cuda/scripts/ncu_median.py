#!/usr/bin/env python3
"""Median of each metric per kernel name from ncu --csv logs (the default
details page, one metric a line; not --page raw).

usage: ncu_median.py NCU.csv...   (one line per file and kernel:
"file kernel metric=median(n=launches) ...")
For comparing two builds' kernels measured the same way (h200-ab-bundles.sh).
"""
import collections
import csv
import statistics
import sys

for path in sys.argv[1:]:
    with open(path) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    if not rows:
        print(f"{path}: no ncu rows")
        continue
    head = rows[0]
    ik, im, iv = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
    by_kernel = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows[1:]:
        try:
            by_kernel[r[ik].split("(")[0]][r[im]].append(float(r[iv].replace(",", "")))
        except ValueError:
            pass  # a metric ncu could not collect ("n/a")
    for kernel, metrics in by_kernel.items():
        cols = " ".join(f"{m}={statistics.median(v):.2f}(n={len(v)})" for m, v in metrics.items())
        print(f"{path.rsplit('/', 1)[-1]} {kernel} {cols}")
