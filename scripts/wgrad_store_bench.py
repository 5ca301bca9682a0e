"""The ping-pong weight gradient storing dw from registers (no shared store buffers, so 6-7 stages fit) against its
TMA stores (4-5 stages), and torch._grouped_mm, on the same routed rows, queued, in turns; every variant's output
checked bit for bit against the TMA-store s4 one first.

    python scripts/wgrad_store_bench.py [--shapes dsv3,qwen3] [--routing balanced,layer-skewed] [--rounds 3]

Why: under Nsight Compute (session 21, calls E and G) the consumers of DeepSeek-V3's FC1 weight gradient wait on
their next tile's data at its start (4 stages hold one 256-row tile of dy and x: the producer cannot load the next
tile until this one's stages free up) and the tensor pipe idles 28%.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels import wgrad_pingpong as wp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3,qwen3")
    ap.add_argument("--routing", default="balanced,layer-skewed")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    shapes = sweep.script_shapes(args.shapes)
    routings = sweep.script_routings(args.routing, layer_skewed=True)
    sweep.require_cuda("scripts/wgrad_store_bench.py")
    variants = {"tma s4": dict(stages=4), "tma s5": dict(stages=5), "reg s6": dict(stages=6, reg_store=True),
                "reg s7": dict(stages=7, reg_store=True), "tma s4 sorted": dict(stages=4, sorted_groups=True),
                "reg s6 sorted": dict(stages=6, reg_store=True, sorted_groups=True)}
    print(f"{'shape':6s} {'layer':5s} {'routing':13s} {'torch':>8s} " + " ".join(f"{v:>13s}" for v in variants),
          flush=True)
    for shape in shapes:
        m, g, h, i = sweep.SHAPES[shape]
        for layer, (n, k) in sweep.layer_gemms(h, i).items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
            for routing in routings:
                offs = sweep.script_group_ends(shape, routing)
                want = torch._grouped_mm(dy.t(), x, offs=offs)
                base = wp.grouped_gemm_wgrad_pingpong(dy, x, offs, stages=4)
                err = sweep.rel_err(base, want)
                if not err < sweep.BOUND:
                    raise SystemExit(f"{shape} {layer} {routing}: rel err {err:.2e} against torch")
                for v, kw in variants.items():
                    if not torch.equal(wp.grouped_gemm_wgrad_pingpong(dy, x, offs, **kw), base):
                        raise SystemExit(f"{shape} {layer} {routing} {v}: not bit for bit the TMA-store s4 output")
                want = base = None
                runs = {"torch": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}
                for v, kw in variants.items():
                    runs[v] = lambda kw=kw: wp.grouped_gemm_wgrad_pingpong(dy, x, offs, **kw)
                med = sweep.script_times(runs, args.rounds, True)
                print(f"{shape:6s} {layer:5s} {routing:13s} {med['torch']:8.3f} "
                      + " ".join(f"{med[v]:13.3f}" for v in variants), flush=True)
            x = dy = None
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
