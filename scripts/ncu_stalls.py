"""The instructions with the most warp-stall samples in a Nsight Compute SASS page (CSV), and the samples by opcode.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SASS.csv
    python scripts/ncu_stalls.py SASS.csv [--top 30]

One kernel per report (profile with -k). Columns are found by name: the address, the SASS text, and the all-samples
and not-issued-samples stall counts.
"""

from __future__ import annotations

import argparse
import collections
import csv
import os


def column(names: list, *words: str) -> int | None:
    for i, n in enumerate(names):
        if all(w.lower() in n.lower() for w in words):
            return i
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    if not os.path.isfile(a.csv):
        raise SystemExit(f"{a.csv}: no such file (a CSV of `ncu -i REPORT --page source --csv --print-source sass`)")
    with open(a.csv, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next((i for i, r in enumerate(rows) if column(r, "Source") is not None and column(r, "Address") is not None),
                  None)
    if header is None:
        print(f"{a.csv}: no Address / Source header")
        return 1
    names = rows[header]
    src, addr = column(names, "Source"), column(names, "Address")
    all_s = column(names, "Warp Stall Sampling (All")
    not_issued = column(names, "Warp Stall Sampling (Not")
    if all_s is None:
        print("no stall-sampling column; columns: " + ", ".join(names))
        return 1

    def num(text: str) -> float:
        try:
            return float(text.replace(",", ""))
        except ValueError:
            return 0.0

    body = [r for r in rows[header + 1:] if len(r) == len(names)]
    total = sum(num(r[all_s]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} samples")
    for r in sorted(body, key=lambda r: -num(r[all_s]))[:a.top]:
        ni = f"{num(r[not_issued]):7.0f}" if not_issued is not None else ""
        print(f"{100 * num(r[all_s]) / total:5.1f}% {ni} {r[addr]:>6s}  {r[src][:90]}")
    by_op = collections.Counter()
    for r in body:
        words = [w for w in r[src].split() if not w.startswith("@")]
        by_op[words[0] if words else "?"] += num(r[all_s])
    print("by opcode: " + ", ".join(f"{op} {100 * s / total:.1f}%" for op, s in by_op.most_common(14)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
