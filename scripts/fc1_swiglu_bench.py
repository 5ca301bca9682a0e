"""FC1's forward with SwiGLU in its epilogue (kernels/rowgroup_pingpong.py, grouped_gemm_fc1_swiglu_pingpong) against
the two steps it replaces, from the layer's inputs (token rows x [T, H] and each routed row's token), on the same
routed rows, in turns, after a check against them:

    torch+swiglu    x_perm = x[token_of_row], torch._grouped_mm, then the SwiGLU kernel (moe_rows.swiglu_fwd, the
                    routing weights as probs) reading h back
    tuned+swiglu    the same with our autotuned forward (its candidates include the plain ping-pong)
    pp s5+swiglu    the same with the plain ping-pong forward, 5 stages (the fused kernel's main loop, alone)
    gather+swiglu   our forward reading x's rows through the index (no x_perm), then the SwiGLU kernel
    fused sN        x_perm, then the fused kernel with N stages (h and a in one pass)

    python scripts/fc1_swiglu_bench.py [--shapes qwen3,gptoss,mixtral,dsv3] [--routing balanced,skewed]
        [--rounds 5] [--stages 5,4]

One row per (shape, routing): ms of each contender, and the best separate path over the best fused variant.
"""

from __future__ import annotations

import argparse

import torch

TOPK = {"dsv3": 8, "dsv3-ep8": 8, "qwen3": 8, "gptoss": 4, "mixtral": 2}  # bench moe's top-k per shape


def main(argv=None) -> int:
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import moe_rows
    from moetrain.kernels import rowgroup_pingpong as rp
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import in_turns, median_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3,gptoss,mixtral,dsv3")
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stages", default="5,4", help="fused variants' pipeline stages (at most 5)")
    args = ap.parse_args(argv)
    shapes, routings = sweep.script_shapes(args.shapes), sweep.script_routings(args.routing)
    stages = sweep.script_stages(args.stages, 5)
    sweep.require_cuda("scripts/fc1_swiglu_bench.py")
    separate = ["torch+swiglu", "tuned+swiglu", "pp s5+swiglu", "gather+swiglu"]
    names = [*separate, *(f"fused s{s}" for s in stages)]
    print(f"{'shape':8s} {'routing':8s} " + " ".join(f"{c:>14s}" for c in names) + "  separate/fused", flush=True)
    for shape in shapes:
        m, g, hid, inter = sweep.SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(g, 2 * inter, hid, device="cuda", generator=gen) / hid ** 0.5).to(torch.bfloat16)
        x = torch.randn(m // TOPK[shape], hid, device="cuda", generator=gen).to(torch.bfloat16)
        token_of_row = torch.randint(0, x.shape[0], (m,), device="cuda", generator=gen, dtype=torch.int32)
        probs = torch.rand(m, device="cuda", generator=gen)
        for routing in routings:
            offs = sweep.group_ends(m, g, routing)

            def rows():
                return x.index_select(0, token_of_row)

            runs = {
                "torch+swiglu": lambda: moe_rows.swiglu_fwd(torch._grouped_mm(rows(), w.transpose(-2, -1), offs=offs),
                                                            "swiglu", probs),
                "tuned+swiglu": lambda: moe_rows.swiglu_fwd(gg.grouped_gemm_fwd(rows(), w, offs), "swiglu", probs),
                "pp s5+swiglu": lambda: moe_rows.swiglu_fwd(
                    rp.grouped_gemm_rowgroup_pingpong(rows(), w, offs, stages=5), "swiglu", probs),
                "gather+swiglu": lambda: moe_rows.swiglu_fwd(gg.grouped_gemm_fwd(x, w, offs, gather_rows=token_of_row),
                                                             "swiglu", probs),
            }
            for s in stages:
                runs[f"fused s{s}"] = lambda s=s: rp.grouped_gemm_fc1_swiglu_pingpong(rows(), w, offs, probs,
                                                                                      stages=s)[1]
            want = runs["torch+swiglu"]()
            for name in names[1:]:
                err = sweep.rel_err(runs[name](), want)
                if not err < sweep.BOUND:
                    raise SystemExit(f"{shape} {routing}: {name} disagrees with torch+swiglu (rel err {err:.2e})")
            want = None
            med, failed = in_turns(names, lambda name: median_ms(runs[name], warmup=2, reps=10), args.rounds)
            if failed:
                raise next(iter(failed.values()))
            best_separate = min(med[n] for n in separate)
            fused = min(med[n] for n in names[len(separate):])
            print(f"{shape:8s} {routing:8s} " + " ".join(f"{med[n]:14.3f}" for n in names)
                  + f"  {best_separate / fused:6.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
