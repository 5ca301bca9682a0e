"""Where the "sorted" weight gradient's cost on balanced routing comes from (GPU): the plain ping-pong, the sorted one
as the layer runs it (its schedule made by schedule.skew_schedule's PyTorch ops on every call), the sorted one with
the schedule made once and reused, and skew_schedule alone; queued (10 calls back to back), in turns.

    python scripts/sorted_schedule_cost.py [--shapes qwen3,dsv3] [--routing balanced,skewed] [--rounds 5]

Why: on balanced routing "sorted" runs exactly the plain kernel's tile order, yet cost 0-11% (session 18, most at
Qwen3's short weight gradients); session 19's producer prefetch showed the per-tile coordinate loads are not it. A
fixed cost per call (the schedule's GPU work) would weigh most on the shortest kernels.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from moetrain.kernels import schedule
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels import wgrad_pingpong as wp
    from moetrain.kernels.timing import in_turns, queued_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3,dsv3")
    ap.add_argument("--routing", default="balanced,skewed")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: at least 1")
    shapes, routings = sweep.script_shapes(args.shapes), sweep.script_routings(args.routing)
    sweep.require_cuda("scripts/sorted_schedule_cost.py")
    names = ("plain", "sorted", "sorted, schedule reused", "skew_schedule alone")
    print(f"{'shape':6s} {'layer':5s} {'routing':8s} " + " ".join(f"{n:>23s}" for n in names) + "   ms", flush=True)
    made = schedule.skew_schedule
    for shape in shapes:
        m, g, h, i = sweep.SHAPES[shape]
        for layer, (n, k) in sweep.layer_gemms(h, i).items():
            gen = torch.Generator(device="cuda").manual_seed(0)
            dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            for routing in routings:
                offs = sweep.group_ends(m, g, routing)
                fixed = made(offs)

                def reused(cfg_offs, step_rows=schedule.STEP_ROWS):
                    return fixed

                def sorted_reused():
                    wp.skew_schedule = reused  # the kernel module's own name for it
                    try:
                        return wp.grouped_gemm_wgrad_pingpong(dy, x, offs, sorted_groups=True)
                    finally:
                        wp.skew_schedule = made

                runs = {"plain": lambda: wp.grouped_gemm_wgrad_pingpong(dy, x, offs),
                        "sorted": lambda: wp.grouped_gemm_wgrad_pingpong(dy, x, offs, sorted_groups=True),
                        "sorted, schedule reused": sorted_reused,
                        "skew_schedule alone": lambda: made(offs)}
                want = runs["plain"]()
                for name in ("sorted", "sorted, schedule reused"):
                    if not torch.equal(runs[name](), want):
                        raise SystemExit(f"{shape} {layer} {routing}: {name} differs from plain")
                want = None
                med, failed = in_turns(list(runs), lambda name: queued_ms(runs[name], reps=10, warmup=2), args.rounds)
                if failed:
                    raise next(iter(failed.values()))
                print(f"{shape:6s} {layer:5s} {routing:8s} " + " ".join(f"{med[c]:23.4f}" for c in names), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
