"""The ping-pong forward / data gradient (kernels/rowgroup_pingpong.py, Gluon) variants against grouped_gemm_fwd /
_dgrad as the layer calls them ("tuned": the autotuner's pick among our Triton configs) and torch._grouped_mm, on the
same routed rows, in turns; outputs checked against torch first.

    python scripts/rowgroup_pingpong_bench.py [--shapes dsv3,qwen3,gptoss,mixtral] [--ops fwd,dgrad]
        [--routing balanced,skewed,layer-skewed] [--rounds 5] [--queued]
        [--variants 128x128/s4/g8,64x256/s3/g8,pingpong/128x128x64/s5/g8,128x256x64/s3/w8/tma/split]

A variant is a ping-pong shorthand BMxTN/sSTAGES/gGROUP_M, or the name of any forward / data gradient config
(grouped_gemm.configs_for, trial ones included), run through grouped_gemm_fwd / _dgrad with config=.
One row per (shape, layer, op, routing): ms and TFLOP/s of each, torch's time over the best variant's, and the
autotuner's pick ("tuned"). Then,
per shape and routing, the sums over the rows: torch, tuned, and the best variant per row.
"""

from __future__ import annotations

import argparse
import collections

import torch


def parse_variants(text: str, tiles, configs) -> dict:
    """name -> the ping-pong's keyword arguments (a shorthand) or a GemmConfig (a config's name)."""
    named = {str(c): c for c in configs}
    variants = {}
    for v in text.split(","):
        if v in named:
            variants[v] = named[v]
            continue
        try:
            tile, stages, group = v.split("/")
            bm, tn = (int(t) for t in tile.split("x"))
            variants[v] = dict(tile=(bm, tn), stages=int(stages.removeprefix("s")), group_m=int(group.removeprefix("g")))
        except ValueError:
            raise SystemExit(f"--variants: {v!r} is neither BMxTN/sSTAGES/gGROUP_M (e.g. 128x128/s4/g8) nor a forward "
                             "config's name (grouped_gemm.configs_for)") from None
        if (bm, tn) not in tiles:
            raise SystemExit(f"--variants: {v!r}: tile one of {tiles}")
    return variants


def tuned_pick(op: str, red: int, width: int) -> str:
    """The autotuner's pick for this op's shape in this process (grouped_gemm_tuning.tuned_configs), by name."""
    from moetrain.kernels.grouped_gemm_tuning import tuned_configs

    picks = [str(cfg) for key, cfg in tuned_configs().items() if key[0] == op and key[3:5] == (width, red)]
    return ", ".join(picks) or "?"


def main(argv=None) -> int:
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import rowgroup_pingpong as rp
    from moetrain.kernels import sweep_grouped_gemm as sweep

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3,qwen3,gptoss,mixtral")
    ap.add_argument("--ops", default="fwd,dgrad")
    ap.add_argument("--layers", default="fc1,fc2")
    ap.add_argument("--routing", default="balanced",
                    help="balanced, skewed (Dirichlet 0.3 shares) and/or layer-skewed (bench moe's skewed routing of "
                         "the same shape)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--queued", action="store_true",
                    help="time 10 calls back to back (kernels.timing.queued_ms), as a layer's kernels run, instead of "
                         "each from an idle GPU (a variant's schedule launch then overlaps the previous call)")
    ap.add_argument("--variants", default="128x128/s4/g8,64x256/s3/g8")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds: {args.rounds}: at least 1")
    variants = parse_variants(args.variants, rp.TILES, gg.configs_for("fwd") + gg.configs_for("dgrad"))
    shapes = sweep.script_shapes(args.shapes)
    if any(o not in ("fwd", "dgrad") for o in args.ops.split(",")):
        raise SystemExit(f"--ops: {args.ops!r}: fwd and/or dgrad")
    routings = sweep.script_routings(args.routing, layer_skewed=True)
    sweep.require_cuda("scripts/rowgroup_pingpong_bench.py")
    print(f"{'shape':8s} {'layer':5s} {'op':5s} {'routing':8s} "
          + " ".join(f"{c:>17s}" for c in ("torch", "tuned", *variants)) + "  torch/best variant", flush=True)
    sums = collections.defaultdict(lambda: collections.defaultdict(float))
    for shape in shapes:
        m, g, h, i = sweep.SHAPES[shape]
        for layer, (n, k) in sweep.layer_gemms(h, i).items():
            if layer not in args.layers.split(","):
                continue
            gen = torch.Generator(device="cuda").manual_seed(0)
            w = torch.randn(g, n, k, device="cuda", generator=gen).to(torch.bfloat16)
            for op in args.ops.split(","):
                dgrad = op == "dgrad"
                a = torch.randn(m, n if dgrad else k, device="cuda", generator=gen).to(torch.bfloat16)
                for routing in routings:
                    offs = sweep.script_group_ends(shape, routing)
                    if dgrad:
                        runs = {"torch": lambda: torch._grouped_mm(a, w, offs=offs),
                                "tuned": lambda: gg.grouped_gemm_dgrad(a, w, offs)}
                    else:
                        runs = {"torch": lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs),
                                "tuned": lambda: gg.grouped_gemm_fwd(a, w, offs)}
                    ours = gg.grouped_gemm_dgrad if dgrad else gg.grouped_gemm_fwd
                    for v, kw in variants.items():
                        if isinstance(kw, dict):
                            runs[v] = lambda kw=kw: rp.grouped_gemm_rowgroup_pingpong(a, w, offs, dgrad=dgrad, **kw)
                        else:  # a config by name
                            runs[v] = lambda cfg=kw: ours(a, w, offs, config=cfg)
                    want = runs["torch"]()
                    for name in list(runs)[1:]:
                        err = sweep.rel_err(runs[name](), want)
                        if not err < sweep.BOUND:
                            raise SystemExit(f"{shape} {layer} {op} {routing}: {name} disagrees with torch "
                                             f"(rel err {err:.2e})")
                    want = None
                    med = sweep.script_times(runs, args.rounds, args.queued)
                    flops = 2.0 * m * n * k
                    cells = " ".join(f"{med[c]:7.3f} {flops / med[c] / 1e9:5.0f} TF/s" for c in runs)
                    best = min(med[v] for v in variants)
                    print(f"{shape:8s} {layer:5s} {op:5s} {routing:8s} {cells}  {med['torch'] / best:6.3f}x  "
                          f"(tuned: {tuned_pick(op, n if dgrad else k, k if dgrad else n)})", flush=True)
                    total = sums[(shape, routing)]
                    total["torch"] += med["torch"]
                    total["tuned"] += med["tuned"]
                    total["best variant"] += best
    print("sums (ms): " + "; ".join(
        f"{s} {r}: torch {t['torch']:.3f}, tuned {t['tuned']:.3f} ({t['torch'] / t['tuned']:.3f}x), "
        f"best variant {t['best variant']:.3f} ({t['torch'] / t['best variant']:.3f}x)" for (s, r), t in sums.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
