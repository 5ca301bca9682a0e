"""Our grouped weight-gradient kernel against torch._grouped_mm (GPU) on the same rows and FLOPs spread over the
experts in different ways, in turns.

    python scripts/wgrad_skew.py [--n 4096] [--k 7168] [--groups 256] [--rows 65536]

Layouts of the same M rows over G experts: balanced (M/G each), skewed (Dirichlet(0.3), the benchmarks'
skew), one expert with half the rows and the rest balanced, and all rows in G/8 experts; ours in bands of
1, 4, 8 and 16 dw row tiles (1: the tile order before bands). Written to test whether big experts thrash L2
(session 4's hypothesis for a 75% loss under skew); session 5 measured 17% (torch 13%) and no big-expert
penalty, bands within noise (bench/NOTES.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch


def layouts(m: int, g: int) -> dict[str, torch.Tensor]:
    """name -> [G] int64 rows per expert, each summing to m."""
    from moetrain.kernels.timing import skewed_offs

    def even(rows: int, groups: int) -> torch.Tensor:
        out = torch.full((groups,), rows // groups, dtype=torch.int64)
        out[: rows - int(out.sum())] += 1
        return out

    skew_ends = skewed_offs(m, g, 0, torch.device("cpu")).long()
    half = torch.cat([torch.tensor([m // 2]), even(m - m // 2, g - 1)])
    few = torch.cat([even(m, g // 8), torch.zeros(g - g // 8, dtype=torch.int64)])
    return {"balanced": even(m, g), "skewed": torch.diff(skew_ends, prepend=skew_ends.new_zeros(1)),
            "one expert 50%": half, f"{g // 8} experts": few}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="dw rows (FC1: 2 x intermediate)")
    ap.add_argument("--k", type=int, default=7168, help="dw columns (FC1: hidden)")
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--rows", type=int, default=65536, help="routed rows M")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("scripts/wgrad_skew.py times GPU kernels: no CUDA device visible")
    from moetrain.kernels import grouped_gemm as kernels
    from moetrain.kernels import grouped_gemm_tuning as tuning
    from moetrain.kernels.timing import in_turns, median_ms

    m, g, n, k = args.rows, args.groups, args.n, args.k
    gen = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    flops = 2.0 * m * n * k
    all_layouts = layouts(m, g)
    # the tile config the autotuner picks on balanced routing, in bands of 1 (the order before bands), 4, 8, 16 dw
    # row tiles: if big groups lose to L2 misses, wider bands win there and cost nothing on balanced routing
    balanced = torch.cumsum(all_layouts["balanced"], 0).to(torch.int32).cuda()
    kernels.grouped_gemm_wgrad(dy, x, balanced)
    picked = next(v for key, v in tuning._BEST.items() if key[0] == "wgrad")
    bands = (1, 4, 8, 16)
    print(f"wgrad dw [{g}, {n}, {k}] over {m} rows, bf16; ms (TFLOP/s); tile config {picked}, bands of dw row tiles")
    print(f"{'layout':16s} {'max rows':>8s} {'chunks/64':>9s} {'torch':>14s} "
          + " ".join(f"{'g' + str(b):>14s}" for b in bands) + f" {'best/torch':>10s}")
    base_chunks = None
    for name, counts in all_layouts.items():
        offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
        runs = {"torch": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}
        for b in bands:
            cfg = dataclasses.replace(picked, group_m=b)
            runs[f"g{b}"] = lambda cfg=cfg: kernels.grouped_gemm_wgrad(dy, x, offs, config=cfg)
        times, failed = in_turns(list(runs), lambda c: median_ms(runs[c], warmup=2, reps=5), 3)
        for c, err in failed.items():
            print(f"  {c} failed: {type(err).__name__}: {err}"[:200])
        chunks = int(sum(max(math.ceil(int(r) / 64), 1) for r in counts))
        base_chunks = base_chunks or chunks
        cell = lambda c: f"{times[c]:6.3f} ({flops / times[c] / 1e9:4.0f})" if c in times else "failed"  # noqa: E731
        ours = [times[c] for c in times if c != "torch"]
        ratio = min(ours) / times["torch"] if ours and "torch" in times else float("nan")
        print(f"{name:16s} {int(counts.max()):8d} {chunks / base_chunks:9.2f} {cell('torch'):>14s} "
              + " ".join(f"{cell('g' + str(b)):>14s}" for b in bands) + f" {ratio:10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
