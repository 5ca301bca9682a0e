"""FC2's data gradient with SwiGLU's backward in its epilogue (kernels/rowgroup_pingpong.py,
grouped_gemm_dgrad_swiglu_pingpong) against the two steps it replaces, on the same routed rows, in turns, after a
check against them: the data gradient (torch._grouped_mm, our tuned Triton kernel, or the plain ping-pong) writing
da [M, I], then the SwiGLU backward kernel (moe_rows.swiglu_bwd, with the routing weights as probs) reading it.

    python scripts/fc2_dgrad_swiglu_bench.py [--shapes qwen3,gptoss,mixtral,dsv3] [--routing balanced,skewed]
        [--rounds 5] [--stages 5,4]

One row per (shape, routing): ms of each contender, and the best separate pair over the best fused variant.
--profile: after the check, the plain ping-pong pair and the first fused variant run once more between
cudaProfilerStart and cudaProfilerStop (for Nsight Compute with --profile-from-start off) instead of being timed.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import moe_rows
    from moetrain.kernels import rowgroup_pingpong as rp
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import in_turns, median_ms, profiled_once

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3,gptoss,mixtral,dsv3")
    ap.add_argument("--routing", default="balanced")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stages", default="5,4", help="fused variants' pipeline stages (at most 6)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    shapes, routings = sweep.script_shapes(args.shapes), sweep.script_routings(args.routing)
    stages = sweep.script_stages(args.stages, 6)
    sweep.require_cuda("scripts/fc2_dgrad_swiglu_bench.py")
    names = ["torch+swiglu_bwd", "tuned+swiglu_bwd", "pingpong+swiglu_bwd", *(f"fused s{s}" for s in stages)]
    print(f"{'shape':8s} {'routing':8s} " + " ".join(f"{c:>19s}" for c in names) + "  separate/fused", flush=True)
    for shape in shapes:
        m, g, hid, inter = sweep.SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(g, hid, inter, device="cuda", generator=gen) / hid ** 0.5).to(torch.bfloat16)
        dy = torch.randn(m, hid, device="cuda", generator=gen).to(torch.bfloat16)
        h = torch.randn(m, 2 * inter, device="cuda", generator=gen).to(torch.bfloat16)
        probs = torch.rand(m, device="cuda", generator=gen)
        for routing in routings:
            offs = sweep.group_ends(m, g, routing)
            runs = {
                "torch+swiglu_bwd": lambda: moe_rows.swiglu_bwd(h, torch._grouped_mm(dy, w, offs=offs), "swiglu", probs),
                "tuned+swiglu_bwd": lambda: moe_rows.swiglu_bwd(h, gg.grouped_gemm_dgrad(dy, w, offs), "swiglu", probs),
                "pingpong+swiglu_bwd": lambda: moe_rows.swiglu_bwd(
                    h, rp.grouped_gemm_rowgroup_pingpong(dy, w, offs, dgrad=True), "swiglu", probs),
            }
            for s in stages:
                runs[f"fused s{s}"] = lambda s=s: rp.grouped_gemm_dgrad_swiglu_pingpong(dy, w, offs, h, probs, stages=s)
            want_dh, want_dp = runs["torch+swiglu_bwd"]()
            for name in names[1:]:
                dh, dp = runs[name]()
                err = max(sweep.rel_err(dh, want_dh), sweep.rel_err(dp[:, None], want_dp[:, None]))
                if not err < sweep.BOUND:
                    raise SystemExit(f"{shape} {routing}: {name} disagrees with torch+swiglu_bwd (rel err {err:.2e})")
            want_dh = want_dp = None
            if args.profile:
                profiled_once(runs["pingpong+swiglu_bwd"], runs[names[3]])
                print(f"{shape:8s} {routing:8s} profiled", flush=True)
                continue
            med, failed = in_turns(names, lambda name: median_ms(runs[name], warmup=2, reps=10), args.rounds)
            if failed:
                raise next(iter(failed.values()))
            separate = min(med[n] for n in names[:3])
            fused = min(med[n] for n in names[3:])
            print(f"{shape:8s} {routing:8s} " + " ".join(f"{med[n]:19.3f}" for n in names)
                  + f"  {separate / fused:6.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
