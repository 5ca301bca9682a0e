"""What skewed routing costs the six expert GEMMs under two schedules, by roofline alone (CPU only, no timing).

    moetrain bench roofline [--tflops 660] [--tbps 4.25] [--tail 64] [--shapes S] [--routing skewed,skewed:1]
                            [--tokens N]

Per group g with r rows and per GEMM: MMA time (rows padded to our tiles: 128-row tiles with a 64-row tail in the
forward and data gradient, 64-row reduction steps, at least one, in the weight gradient) at --tflops, and HBM time
at --tbps for the bytes the group must move: its weight slice read (forward, data gradient) or its dw written
(weight gradient), plus its own activation rows. Two schedules:
  in step   every program on the same group at once (group-major tiles: the weight gradient's 1,792 tiles per
            DeepSeek-V3 expert keep all 132 SMs on one group), so each group takes max(MMA, HBM): the sum of maxima
  mixed     store- or load-bound groups under MMA-bound ones: max(sum of MMA, sum of HBM)
Printed per layer shape and routing (bench moe's: balanced first, then --routing's): the six GEMMs' time under both,
over balanced's, and the in-step time per token (to set --tokens runs beside each other: balanced routing is
padding-free only where every group's rows are a multiple of 128). bench/grouped_gemm.md sets them beside the
measured layers.
"""

from __future__ import annotations

import argparse
import math

from moetrain.bench.common import (
    SHAPES,
    at_least,
    parse_routings,
    parse_shapes,
    shape_at,
)
from moetrain.bench.moe_layer import routed_rows

TAIL = 64  # the finest rows a group's last tile or reduction step computes with our tiles (a warpgroup MMA's M)


def padded(r: int, op: str, tail: int = TAIL) -> int:
    """Rows our tiles compute for a group of r rows (the forward / data gradient's tail split; wgrad's steps). With
    ``tail`` < 64 (what tiles with the rows as the MMA's N, "swap-AB", would allow): a group's last partial tile or
    reduction step rounds up to ``tail`` rows instead of 64."""
    if op == "wgrad":
        body, rem = divmod(r, 64)
        return max(tail, body * 64 + (math.ceil(rem / tail) * tail if rem else 0))
    body, rem = divmod(r, 128)
    if rem == 0:
        return body * 128
    return body * 128 + (128 if rem > 64 else math.ceil(rem / tail) * tail)


def group_times(r: int, n: int, k: int, tflops: float, tbps: float, tail: int = TAIL) -> list[tuple[float, float]]:
    """(MMA s, HBM s) of one group's forward, data gradient and weight gradient for w [N, K] (bf16)."""
    weight = n * k * 2
    rows = r * (n + k) * 2  # the group's input and output rows (or dy and x for the weight gradient)
    return [(2.0 * padded(r, op, tail) * n * k / (tflops * 1e12), (weight + rows) / (tbps * 1e12))
            for op in ("fwd", "dgrad", "wgrad")]


def layer_times(rows: list[int], h: int, i: int, tflops: float, tbps: float, tail: int = TAIL) -> tuple[float, float]:
    """The six GEMMs (FC1 w [2I, H], FC2 w [H, I]) in step and mixed, seconds."""
    in_step, mma, hbm = 0.0, 0.0, 0.0
    for n, k in ((2 * i, h), (h, i)):
        for r in rows:
            for c, m in group_times(r, n, k, tflops, tbps, tail):
                in_step += max(c, m)
                mma += c
                hbm += m
    return in_step, max(mma, hbm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain bench roofline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tflops", type=float, default=660.0, help="dense bf16 MMA rate (the H200's GEMMs: 660-790)")
    ap.add_argument("--tbps", type=float, default=4.25, help="HBM bandwidth (the H200's copy: 4.25 TB/s)")
    ap.add_argument("--tail", type=int, default=TAIL, help="rows of a group's last tile / step (64 now; 16 or 32: "
                    "what swap-AB tiles for light groups would allow)")
    ap.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b,deepseek-v3-ep8,gpt-oss-20b,mixtral-8x7b",
                    help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--routing", default="skewed",
                    help="bench moe routings to set beside balanced, comma-separated (skewed, skewed:A, balanced)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per layer call instead of each shape's own T")
    args = ap.parse_args(argv)
    routings = parse_routings(args.routing)
    names = parse_shapes(args.shapes)
    at_least("--tokens", args.tokens, 1, "token per layer call")
    at_least("--tail", args.tail, 1, "row")
    print(f"{'shape':16s} {'tokens':>6s} {'routing':12s} {'in step ms':>10s} {'skew':>7s} {'mixed ms':>9s} "
          f"{'skew':>7s} {'in step us/token':>16s}")
    for name in names:
        s = shape_at(name, args.tokens)
        base = None
        for routing in ["balanced"] + [r for r in routings if r != "balanced"]:
            rows = routed_rows(s, routing, "cpu").tolist()
            step, mix = layer_times(rows, s.H, s.I, args.tflops, args.tbps, args.tail)
            base = base or (step, mix)
            print(f"{name:16s} {s.T:6d} {routing:12s} {1e3 * step:10.2f} {100 * (step / base[0] - 1):+6.1f}% "
                  f"{1e3 * mix:9.2f} {100 * (mix / base[1] - 1):+6.1f}% {1e6 * step / s.T:16.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
