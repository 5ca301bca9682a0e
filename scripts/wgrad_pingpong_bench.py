"""The ping-pong weight gradient (kernels/wgrad_pingpong.py, Gluon) variants against grouped_gemm_wgrad as the layer
calls it ("tuned": the autotuner's pick, which since session 10 may itself be a ping-pong config) and
torch._grouped_mm, on the same routed rows, in turns; outputs checked against torch first.

    python scripts/wgrad_pingpong_bench.py [--shapes dsv3,qwen3,dsv3-ep8] [--routing balanced,skewed] [--rounds 5]
    python scripts/wgrad_pingpong_bench.py --shapes dsv3 --layers fc1 --routing balanced --groups 64 --profile
    python scripts/wgrad_pingpong_bench.py --shapes dsv3 --routing uniform:16,balanced,skewed --fill

Prints one row per (shape, layer, routing): ms and TFLOP/s of each, and the tuned pick's time over the best variant's.
--groups keeps the shape's rows per expert with fewer experts (a smaller dw for a profiler's replays). --profile:
after the check, each contender runs once more between cudaProfilerStart and cudaProfilerStop (for Nsight Compute
with --profile-from-start off) instead of being timed.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels import wgrad_pingpong as wp
    from moetrain.kernels.timing import profiled_once

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3,qwen3,dsv3-ep8")
    ap.add_argument("--routing", default="balanced,skewed",
                    help="balanced, skewed (Dirichlet 0.3 shares: kernels.timing.skewed_offs), layer-skewed (bench "
                         "moe's skewed routing of the same shape: K distinct experts per token), uniform:R (every "
                         "group R rows: R = 16 makes every tile one store-bound step)")
    ap.add_argument("--queued", action="store_true",
                    help="time 10 calls back to back (kernels.timing.queued_ms), as a layer's kernels run, instead of "
                         "each call from an idle GPU: the host's launch work (a schedule's torch ops: ~0.3-0.5 ms, "
                         "session 18) is hidden, as in a layer")
    ap.add_argument("--fill", action="store_true",
                    help="also time dw.zero_() on a buffer of dw's size: the store floor of a weight gradient")
    ap.add_argument("--layers", default="fc1,fc2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=None, help="experts (rows per expert kept)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", default="128x128/s3/g8,128x128/s4/g8",
                    help="ping-pong variants: TNxTK/sSTAGES/gGROUP_N[/cCOHORTS, /mix or /sorted (groups heaviest "
                         "first, programs in step)], comma-separated")
    ap.add_argument("--gather", action="store_true",
                    help="FC1's case: x is [M/8, K] token rows read through a top-8 index. Every contender but "
                         "'triton gather' and the ping-pong variants pays for the permuted copy x[rows] (timed with "
                         "it); the variants gather the rows themselves (128x128 tiles, K a multiple of 128)")
    args = ap.parse_args(argv)
    variants = {}
    for v in args.variants.split(","):
        try:
            tile, stages, group, *schedule = v.split("/")
            tn, tk = (int(t) for t in tile.split("x"))
            variants[v] = dict(tile=(tn, tk), stages=int(stages.removeprefix("s")),
                               group_n=int(group.removeprefix("g")))
            if schedule == ["mix"]:
                variants[v]["mix"] = True
            elif schedule == ["sorted"]:  # groups heaviest first, every program in step
                variants[v]["sorted_groups"] = True
            elif schedule:
                variants[v]["cohorts"] = int(schedule[0].removeprefix("c"))
                if len(schedule) > 1 or variants[v]["cohorts"] not in wp.COHORT_CHOICES:
                    raise ValueError
        except ValueError:
            raise SystemExit(f"--variants: {v!r} is not TNxTK/sSTAGES/gGROUP_N[/cCOHORTS or /mix] (e.g. 128x128/s4/g8,"
                             f" 128x128/s4/g8/c2, 128x128/s4/g8/mix; cohorts one of {wp.COHORT_CHOICES})") from None
        if args.gather and (tn, tk) != (128, 128):
            raise SystemExit(f"--variants: {v!r}: gathered rows need 128x128 tiles")
    bad = [r for r in args.routing.split(",") if r not in ("balanced", "skewed", "layer-skewed")
           and not (r.startswith("uniform:") and r.removeprefix("uniform:").isdigit())]
    if bad or ("layer-skewed" in args.routing and args.groups):
        raise SystemExit(f"--routing: {args.routing!r}: balanced, skewed, layer-skewed (not with --groups) or "
                         "uniform:R")
    shapes = sweep.script_shapes(args.shapes)
    sweep.require_cuda("scripts/wgrad_pingpong_bench.py")
    extra = ("triton gather", "pingpong copy") if args.gather else ()
    extra += ("dw fill",) if args.fill else ()
    print(f"{'shape':10s} {'layer':5s} {'routing':8s} "
          + " ".join(f"{c:>17s}" for c in ("torch", "tuned", *extra, *variants)) + "  tuned/best variant",
          flush=True)
    for shape in shapes:
        m, g, h, i = sweep.SHAPES[shape]
        if args.groups:
            m, g = m // g * args.groups, args.groups
        for layer, (n, k) in sweep.layer_gemms(h, i).items():
            if layer not in args.layers.split(",") or (args.gather and layer != "fc1"):
                continue
            gen = torch.Generator(device="cuda").manual_seed(0)
            dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
            x = torch.randn(m // 8 if args.gather else m, k, device="cuda", generator=gen).to(torch.bfloat16)
            rows = (torch.randperm(m, device="cuda", generator=gen).remainder(m // 8).to(torch.int32) if args.gather
                    else None)
            for routing in args.routing.split(","):
                if routing.startswith("uniform:"):  # the rows past g * R belong to no group
                    per_group = min(int(routing.removeprefix("uniform:")), m // g)
                    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * per_group
                elif args.groups:
                    offs = sweep.group_ends(m, g, routing)
                else:
                    offs = sweep.script_group_ends(shape, routing)
                if args.gather:
                    runs = {"torch": lambda: torch._grouped_mm(dy.t(), x[rows.long()], offs=offs),
                            "tuned": lambda: gg.grouped_gemm_wgrad(dy, x[rows.long()], offs),
                            "triton gather": lambda: gg.grouped_gemm_wgrad(dy, x, offs, gather_rows=rows),
                            "pingpong copy": lambda: wp.grouped_gemm_wgrad_pingpong(dy, x[rows.long()], offs)}
                    for v, kw in variants.items():
                        runs[v] = lambda kw=kw: wp.grouped_gemm_wgrad_pingpong(dy, x, offs, gather_rows=rows, **kw)
                else:
                    runs = {"torch": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                            "tuned": lambda: gg.grouped_gemm_wgrad(dy, x, offs)}
                    for v, kw in variants.items():
                        runs[v] = lambda kw=kw: wp.grouped_gemm_wgrad_pingpong(dy, x, offs, **kw)
                want = runs["torch"]()
                for name in list(runs)[1:]:  # (before "dw fill" joins: it computes nothing)
                    err = sweep.rel_err(runs[name](), want)
                    if not err < sweep.BOUND:
                        raise SystemExit(f"{shape} {layer} {routing}: {name} disagrees with torch (rel err {err:.2e})")
                if args.fill:
                    runs["dw fill"] = want.zero_  # torch's output as the buffer: dw's size
                else:
                    want = None
                if args.profile:
                    profiled_once(*runs.values())
                    print(f"{shape:10s} {layer:5s} {routing:8s} profiled (M={m} G={g} N={n} K={k})", flush=True)
                    continue
                med = sweep.script_times(runs, args.rounds, args.queued)
                flops = 2.0 * int(offs[-1]) * n * k  # the grouped rows' MMAs (uniform:R leaves rows out)
                dw_bytes = 2.0 * g * n * k
                cells = " ".join(f"{med[c]:7.3f} {flops / med[c] / 1e9:5.0f} TF/s" if c != "dw fill" else
                                 f"{med[c]:7.3f} {dw_bytes / med[c] / 1e6:5.0f} GB/s" for c in runs)
                best = min(med[v] for v in variants)
                print(f"{shape:10s} {layer:5s} {routing:8s} {cells}  {med['tuned'] / best:6.3f}x  (dw "
                      f"{dw_bytes / 1e9:.2f} GB: {dw_bytes / best / 1e6:.0f} GB/s by the best variant)", flush=True)
                want = None
    from moetrain.kernels.grouped_gemm_tuning import tuned_configs

    for key, cfg in sorted(tuned_configs().items(), key=str):  # what "tuned" ran with
        print(f"tuned {'|'.join(str(k) for k in key)}: {cfg}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
