"""A short table of chosen Nsight Compute metrics per profiled kernel, from a report's raw page.

    ncu -i REPORT.ncu-rep --page raw --csv > RAW.csv
    python scripts/ncu_table.py RAW.csv

Columns (whichever the report has): duration, DRAM bytes read / written and throughput, L2 throughput and hit rate,
L2->SM bytes, the tensor pipe's active cycles (of elapsed), SM throughput. One row per kernel launch in the report.
"""

from __future__ import annotations

import csv
import os
import sys

# (label, metric name, scale from its base unit: ns, bytes or %; UNIT_SCALE brings a report's unit to that base)
METRICS = (
    ("ms", "gpu__time_duration.sum", 1e-6),
    ("dram rd GB", "dram__bytes_read.sum", 1e-9),
    ("dram wr GB", "dram__bytes_write.sum", 1e-9),
    ("dram %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", 1.0),
    ("L2->SM GB", "l1tex__m_xbar2l1tex_read_bytes.sum", 1e-9),
    ("tensor %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", 1.0),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
)
UNIT_SCALE = {"ns": 1.0, "nsecond": 1.0, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "byte": 1.0,
              "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "%": 1.0}


def main(path: str) -> int:
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such file (a CSV of `ncu -i REPORT --page raw --csv`)")
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if header is None:
        print(f"{path}: no 'Kernel Name' column (not a raw-page CSV?)")
        return 1
    names, units = rows[header], rows[header + 1]
    col = {n: i for i, n in enumerate(names)}
    present = [(label, m, s) for label, m, s in METRICS if m in col]
    missing = [m for _, m, _ in METRICS if m not in col]
    print("kernel".ljust(34) + "".join(f"{label:>11s}" for label, _, _ in present))
    for r in rows[header + 2:]:
        if len(r) < len(names):
            continue
        cells = []
        for _label, m, scale in present:
            raw = r[col[m]].replace(",", "")
            try:
                value = float(raw) * UNIT_SCALE.get(units[col[m]], 1.0) * scale
                cells.append(f"{value:11.2f}")
            except ValueError:
                cells.append(f"{raw[:10]:>11s}")
        print(r[col["Kernel Name"]][:33].ljust(34) + "".join(cells))
    if missing:
        print("not in the report: " + ", ".join(missing))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1]))
