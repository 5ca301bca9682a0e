"""The ping-pong forward / data gradient (kernels/rowgroup_pingpong.py, Gluon) variants against grouped_gemm_fwd /
_dgrad as the layer calls them ("tuned": the autotuner's pick among our Triton configs) and torch._grouped_mm, on the
same routed rows, in turns; outputs checked against torch first.

    python scripts/rowgroup_pingpong_bench.py [--shapes dsv3,qwen3,gptoss,mixtral] [--ops fwd,dgrad]
        [--routing balanced,skewed] [--rounds 5] [--variants 128x128/s4/g8,64x256/s3/g8]

One row per (shape, layer, op, routing): ms and TFLOP/s of each, and torch's time over the best variant's. Then,
per shape and routing, the sums over the rows: torch, tuned, and the best variant per row.
"""

from __future__ import annotations

import argparse
import collections

import torch


def parse_variants(text: str, tiles) -> dict:
    variants = {}
    for v in text.split(","):
        try:
            tile, stages, group = v.split("/")
            bm, tn = (int(t) for t in tile.split("x"))
            variants[v] = dict(tile=(bm, tn), stages=int(stages.removeprefix("s")), group_m=int(group.removeprefix("g")))
        except ValueError:
            raise SystemExit(f"--variants: {v!r} is not BMxTN/sSTAGES/gGROUP_M (e.g. 128x128/s4/g8)") from None
        if (bm, tn) not in tiles:
            raise SystemExit(f"--variants: {v!r}: tile one of {tiles}")
    return variants


def main(argv=None) -> int:
    from moetrain.kernels import grouped_gemm as gg
    from moetrain.kernels import rowgroup_pingpong as rp
    from moetrain.kernels import sweep_grouped_gemm as sweep
    from moetrain.kernels.timing import in_turns, median_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="dsv3,qwen3,gptoss,mixtral")
    ap.add_argument("--ops", default="fwd,dgrad")
    ap.add_argument("--layers", default="fc1,fc2")
    ap.add_argument("--routing", default="balanced", help="balanced and/or skewed (Dirichlet 0.3 shares)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="128x128/s4/g8,64x256/s3/g8")
    args = ap.parse_args(argv)
    variants = parse_variants(args.variants, rp.TILES)
    shapes = sweep.script_shapes(args.shapes)
    if any(o not in ("fwd", "dgrad") for o in args.ops.split(",")):
        raise SystemExit(f"--ops: {args.ops!r}: fwd and/or dgrad")
    routings = sweep.script_routings(args.routing)
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
                    offs = sweep.group_ends(m, g, routing)
                    if dgrad:
                        runs = {"torch": lambda: torch._grouped_mm(a, w, offs=offs),
                                "tuned": lambda: gg.grouped_gemm_dgrad(a, w, offs)}
                    else:
                        runs = {"torch": lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs),
                                "tuned": lambda: gg.grouped_gemm_fwd(a, w, offs)}
                    for v, kw in variants.items():
                        runs[v] = lambda kw=kw: rp.grouped_gemm_rowgroup_pingpong(a, w, offs, dgrad=dgrad, **kw)
                    want = runs["torch"]()
                    for name in list(runs)[1:]:
                        err = sweep.rel_err(runs[name](), want)
                        if not err < sweep.BOUND:
                            raise SystemExit(f"{shape} {layer} {op} {routing}: {name} disagrees with torch "
                                             f"(rel err {err:.2e})")
                    want = None
                    med, failed = in_turns(list(runs), lambda name: median_ms(runs[name], warmup=2, reps=10),
                                           args.rounds)
                    if failed:
                        raise next(iter(failed.values()))
                    flops = 2.0 * m * n * k
                    cells = " ".join(f"{med[c]:7.3f} {flops / med[c] / 1e9:5.0f} TF/s" for c in runs)
                    best = min(med[v] for v in variants)
                    print(f"{shape:8s} {layer:5s} {op:5s} {routing:8s} {cells}  {med['torch'] / best:6.3f}x",
                          flush=True)
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
