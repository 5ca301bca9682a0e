"""The SwiGLU row kernels (kernels/moe_rows.py: forward with probs, backward with probs, as the layer calls them) with
the tile width picked to leave the fewest masked lanes (session 14) against the previous pick (the next power of two
of I, up to 1024), in turns, after checking that both give the same results.

    python scripts/swiglu_tile_bench.py [--shapes qwen3,gptoss,mixtral,dsv3] [--rounds 7]

Only I's that are not a power of two can differ (Qwen3's 768: 256 columns instead of 1024, which left a quarter of
the lanes idle); the other shapes time the same tile twice, which shows the run's noise. Bytes: forward reads h and
writes a (3 M I x 2), backward reads h and da and writes dh (5 M I x 2).
"""

from __future__ import annotations

import argparse

import torch


def previous_tile_shape(inter: int) -> tuple[int, int]:
    """Before session 14: the row kernels' column block of I (the next power of two, 16..1024), ~4096 elements."""
    from moetrain.kernels.moe_rows import _block

    block = _block(inter)
    return max(1, 4096 // block), block


def main(argv=None) -> int:
    from moetrain.kernels import moe_rows
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import in_turns, median_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3,gptoss,mixtral,dsv3")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    shapes = sweep.script_shapes(args.shapes)
    sweep.require_cuda("scripts/swiglu_tile_bench.py")
    rules = {"previous": previous_tile_shape, "fewest idle": moe_rows._swiglu_tile_shape}
    print(f"{'shape':8s} {'tiles (previous, new)':>24s} {'op':4s} {'previous ms':>12s} {'new ms':>8s} "
          f"{'TB/s':>11s} {'speedup':>8s}", flush=True)
    for name in shapes:
        m, _groups, _h, inter = sweep.SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(m, 2 * inter, device="cuda", generator=gen).to(torch.bfloat16)
        da = torch.randn(m, inter, device="cuda", generator=gen).to(torch.bfloat16)
        probs = torch.rand(m, device="cuda", generator=gen)
        ops = {"fwd": lambda: moe_rows.swiglu_fwd(h, "swiglu", probs),
               "bwd": lambda: moe_rows.swiglu_bwd(h, da, "swiglu", probs)}
        outs = {}
        for rule, tile_shape in rules.items():
            moe_rows._swiglu_tile_shape = tile_shape
            outs[rule] = [ops["fwd"](), *ops["bwd"]()]
        (a0, dh0, dp0), (a1, dh1, dp1) = outs.values()
        if not (torch.equal(a0, a1) and torch.equal(dh0, dh1)) or not torch.allclose(dp0, dp1, rtol=1e-5, atol=1e-5):
            raise SystemExit(f"{name}: the two tile widths disagree")
        for op, run in ops.items():
            def time_one(rule, run=run):
                moe_rows._swiglu_tile_shape = rules[rule]
                return median_ms(run, warmup=2, reps=10)
            times, failed = in_turns(list(rules), time_one, args.rounds)
            if failed:
                raise SystemExit(f"{name} {op}: {failed}")
            bytes_moved = (3 if op == "fwd" else 5) * m * inter * 2
            old, new = times["previous"], times["fewest idle"]
            tiles = f"{previous_tile_shape(inter)} {rules['fewest idle'](inter)}"
            print(f"{name:8s} {tiles:>24s} {op:4s} {old:12.3f} {new:8.3f} {bytes_moved / old / 1e9:5.2f}/"
                  f"{bytes_moved / new / 1e9:5.2f} {old / new:7.3f}x", flush=True)
        moe_rows._swiglu_tile_shape = rules["fewest idle"]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
