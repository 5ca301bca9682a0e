"""How much MMA work skewed routing adds through padding alone, for our tile shapes (CPU only, no timing).

    python scripts/padding_floor.py [--seed 0]

Rows per expert from the benchmarks' skewed routing (kernels.timing.skewed_offs, Dirichlet 0.3). Forward and data
gradient: 128-row tiles, with a 64-row tail tile when the remainder fits in half a tile (the tail split). Weight
gradient: 64-row reduction steps, at least one per expert (its zero tile is still computed and stored). Printed:
padded rows over balanced routing's, which need no padding at these shapes. A kernel whose time follows its MMAs
cannot be closer to balanced than this under the same tiles.
"""

from __future__ import annotations

import argparse
import math

import torch


def padded_rows(rows: list[int]) -> tuple[int, int]:
    """(forward/data-gradient rows computed, weight-gradient rows computed) for these per-expert row counts."""
    fwd = 0
    for r in rows:
        body, rem = divmod(r, 128)
        fwd += body * 128 + (0 if rem == 0 else 64 if rem <= 64 else 128)
    wgrad = sum(max(1, math.ceil(r / 64)) * 64 for r in rows)
    return fwd, wgrad


def main(argv=None) -> int:
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import skewed_offs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("dsv3", "qwen3", "dsv3-ep8", "gptoss", "mixtral"):
        m, g, _, _ = sweep.SHAPES[name]
        ends = skewed_offs(m, g, args.seed, torch.device("cpu"))
        rows = torch.diff(ends, prepend=torch.zeros(1, dtype=ends.dtype)).tolist()
        fwd, wgrad = padded_rows(rows)
        fwd_bal, wgrad_bal = padded_rows([m // g] * g)
        small = sum(r < 64 for r in rows)
        print(f"{name:9s} {g:4d} experts, {small:3d} with < 64 rows: forward/data gradient +{100 * (fwd / fwd_bal - 1):4.1f}%"
              f", weight gradient +{100 * (wgrad / wgrad_bal - 1):4.1f}% rows over balanced", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
