"""How evenly a persistent weight gradient's tiles share out over the programs, under each tile schedule (CPU only).

    python scripts/tile_balance.py [--programs 132]

The weight gradient's tiles are 128x128 dw tiles, every group's in a row; a tile costs its group's reduction steps
(64 rows each, at least one). Program p takes tiles p, p + P, p + 2P, ... (round-robin); "heavy first" orders the
groups by rows first (schedule.skew_schedule); "snake" deals odd full rounds from the last program down (the mix
schedule does both). Printed: the busiest program's work over the mean, on bench moe's routings: the kernel's time
follows the busiest program.
"""

from __future__ import annotations

import argparse
import math

import torch


def busiest_over_mean(rows: list[int], per_group: int, order, programs: int, snake: bool) -> float:
    work = [0] * programs
    t = 0
    total = len(rows) * per_group
    for g in order:
        steps = max(1, math.ceil(rows[g] / 64))
        for _ in range(per_group):
            j, p = divmod(t, programs)
            if snake and j % 2 and j < total // programs:
                p = programs - 1 - p
            work[p] += steps
            t += 1
    return max(work) / (sum(work) / programs)


def main(argv=None) -> int:
    from moetrain.bench import moe_layer as ml
    from moetrain.kernels import sweep_grouped_gemm as sweep

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=132, help="persistent programs (the H200's SMs)")
    args = ap.parse_args(argv)
    print(f"{'shape':16s} {'routing':8s} {'layer':5s} {'plain':>7s} {'snake':>7s} {'heavy first':>12s} {'mix':>7s}")
    for name in ("deepseek-v3", "qwen3-30b-a3b", "deepseek-v3-ep8", "gpt-oss-20b", "mixtral-8x7b"):
        s = ml.SHAPES[name]
        for routing in ("balanced", "skewed"):
            rows = ml.routed_rows(s, routing, torch.device("cpu")).tolist()
            heavy = sorted(range(len(rows)), key=lambda g: -rows[g])  # stable, as skew_schedule
            for layer, (n, k) in sweep.layer_gemms(s.H, s.I).items():
                per_group = math.ceil(n / 128) * math.ceil(k / 128)
                cells = [busiest_over_mean(rows, per_group, order, args.programs, snake)
                         for order, snake in ((range(len(rows)), False), (range(len(rows)), True), (heavy, False),
                                              (heavy, True))]
                print(f"{name:16s} {routing:8s} {layer:5s} " + " ".join(f"{c:7.3f}" for c in cells[:2])
                      + f" {cells[2]:12.3f} {cells[3]:7.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
