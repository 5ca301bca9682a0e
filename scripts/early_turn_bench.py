"""The ping-pong kernels with the MMA turn handed over early (after a tile's last MMAs are issued, as CUTLASS's
ping-pong orders its math warpgroups) or late (after they complete), against torch._grouped_mm, on the same routed
rows, queued, in turns; each variant's output checked bit for bit against the other's first.

    python scripts/early_turn_bench.py [--shapes dsv3,qwen3] [--routing balanced,layer-skewed] [--rounds 3]

Why: under Nsight Compute (session 21, call E) the weight gradient's tensor pipe idled 28% of DeepSeek-V3's FC1
launch, and a DeepSeek-V3 weight-gradient tile has only 4 reduction steps: handed over late, the other warpgroup's
first MMA waits for this tile's last to drain, once per tile.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from moetrain.kernels import rowgroup_pingpong as rp
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels import wgrad_pingpong as wp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3,qwen3")
    ap.add_argument("--routing", default="balanced,layer-skewed")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    shapes = sweep.script_shapes(args.shapes)
    routings = sweep.script_routings(args.routing, layer_skewed=True)
    sweep.require_cuda("scripts/early_turn_bench.py")
    kernels = {
        "wgrad s4/g8": lambda a, w, dy, x, offs, early: wp.grouped_gemm_wgrad_pingpong(dy, x, offs, stages=4,
                                                                                     early_turn=early),
        "wgrad s4/g8/sorted": lambda a, w, dy, x, offs, early: wp.grouped_gemm_wgrad_pingpong(
            dy, x, offs, stages=4, sorted_groups=True, early_turn=early),
        "fwd s5": lambda a, w, dy, x, offs, early: rp.grouped_gemm_rowgroup_pingpong(x, w, offs, stages=5,
                                                                                   early_turn=early),
        "dgrad s5": lambda a, w, dy, x, offs, early: rp.grouped_gemm_rowgroup_pingpong(dy, w, offs, dgrad=True,
                                                                                     stages=5, early_turn=early),
    }
    torch_ops = {"wgrad s4/g8": lambda w, dy, x, offs: torch._grouped_mm(dy.t(), x, offs=offs),
                 "fwd s5": lambda w, dy, x, offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                 "dgrad s5": lambda w, dy, x, offs: torch._grouped_mm(dy, w, offs=offs)}
    print(f"{'shape':6s} {'layer':5s} {'routing':13s} {'kernel':19s} {'torch':>8s} {'late':>8s} {'early':>8s} "
          f"{'late/early':>10s}", flush=True)
    for shape in shapes:
        m, g, h, i = sweep.SHAPES[shape]
        for layer, (n, k) in sweep.layer_gemms(h, i).items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
            w = (torch.randn(g, n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
            for routing in routings:
                offs = sweep.script_group_ends(shape, routing)
                for name, run in kernels.items():
                    late = run(None, w, dy, x, offs, False)
                    early = run(None, w, dy, x, offs, True)
                    if not torch.equal(late, early):
                        raise SystemExit(f"{shape} {layer} {routing} {name}: early and late turns disagree")
                    ref = torch_ops.get(name, torch_ops["wgrad s4/g8"])
                    err = sweep.rel_err(early, ref(w, dy, x, offs))
                    if not err < sweep.BOUND:
                        raise SystemExit(f"{shape} {layer} {routing} {name}: rel err {err:.2e} against torch")
                    late = early = None
                    runs = {"torch": lambda: ref(w, dy, x, offs),
                            "late": lambda: run(None, w, dy, x, offs, False),
                            "early": lambda: run(None, w, dy, x, offs, True)}
                    med = sweep.script_times(runs, args.rounds, True)
                    print(f"{shape:6s} {layer:5s} {routing:13s} {name:19s} {med['torch']:8.3f} {med['late']:8.3f} "
                          f"{med['early']:8.3f} {med['late'] / med['early']:10.3f}", flush=True)
            x = dy = w = None
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
