#!/usr/bin/env python3
"""Table of h200-ncu-detail.sh's raw ncu CSVs: per profiled kernel its time,
DRAM and SM throughput (% of peak), issue-slot use, achieved occupancy,
registers and the blocks per SM they allow, the L2 hit rate, DRAM bytes
(MB, from the mean DRAM rate and the duration) and the three largest warp
stall reasons (cycles per issued instruction).

    python3 crates/mirage-cuda/scripts/ncu_detail_table.py ncu-dense.csv ncu-sparse.csv
"""
import csv
import sys

COLS = [
    ("us", "gpu__time_duration.sum", 1e-3),
    ("DRAM%", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("SM%", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("issue%", "sm__issue_active.avg.pct_of_peak_sustained_elapsed", 1),
    ("occ%", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("regs", "launch__registers_per_thread", 1),
    ("blocks/SM (regs)", "launch__occupancy_limit_registers", 1),
    ("L2 hit%", "lts__t_sector_hit_rate.pct", 1),
]
STALL = "smsp__average_warps_issue_stalled_"
STALL_END = "_per_issue_active.ratio"


def num(v):
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if not l.startswith("==")]
    r = list(csv.reader(lines))
    if len(r) < 3:
        return [], {}
    head, units = r[0], r[1]
    unit = dict(zip(head, units))
    return [dict(zip(head, x)) for x in r[2:]], unit


def scale(name, unit, v, default):
    # Units vary with ncu versions (ns / usecond, byte / Mbyte): normalise.
    u = unit.get(name, "")
    if name == "gpu__time_duration.sum":
        return v * {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(u, 1e-3)
    return v * default


def main():
    print("| kernel | grid | block | " + " | ".join(c[0] for c in COLS) + " | DRAM MB | top stalls (cycles/issue) |")
    print("|" + " --- |" * (5 + len(COLS)))
    for path in sys.argv[1:]:
        data, unit = rows(path)
        for d in data:
            vals = []
            for label, name, k in COLS:
                v = num(d.get(name, ""))
                vals.append("-" if v is None else f"{scale(name, unit, v, k):.1f}")
            rate, dur = num(d.get("dram__bytes.sum.per_second", "")), num(d.get("gpu__time_duration.sum", ""))
            if rate is not None and dur is not None:
                vals.append(f"{rate * scale('gpu__time_duration.sum', unit, dur, 1) * 1e-12:.1f}")
            else:
                vals.append("-")
            stalls = sorted(
                ((num(v) or 0.0, n[len(STALL):-len(STALL_END)]) for n, v in d.items()
                 if n.startswith(STALL) and n.endswith(STALL_END)),
                reverse=True,
            )[:3]
            top = ", ".join(f"{n} {v:.1f}" for v, n in stalls)
            name = d.get("Kernel Name", "?").split("(")[0]
            print(f"| {name} | {d.get('Grid Size', '?')} | {d.get('Block Size', '?')} | "
                  + " | ".join(vals) + f" | {top} |")


if __name__ == "__main__":
    main()
