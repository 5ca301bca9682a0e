"""FC1's forward over token rows: a permuted copy of x then a GEMM reading whole boxes, against the ping-pong GEMM
gathering the rows itself by one TMA copy per row (kernels/row_gather.py), at the benchmark shapes.

Contenders per shape and token order (every one in turns, one process, the same routing):
- torch:        x_perm = token_rows(x) (our row copy), then torch._grouped_mm (the peer);
- copy+box:     the same copy, then our ping-pong forward;
- gather:       our ping-pong forward gathering x's rows (no x_perm): TMA row copies from four loader warps, or
                some of the warps by cp.async ("cpN");
- fused copy / fused gather: FC1 with SwiGLU in its epilogue (moe_fc1_swiglu's "fused" / "fused_gather").
Routing: the benchmarks' balanced (token t to experts t*K.. mod E) or skewed (Dirichlet 0.3) top-k, with tokens in
their own order or relabeled by a random permutation (a trained router's: a token's K rows far apart in time).
Tiles 128x128 (stages 4; fused 5) or 64x256 ("wide", stages 4), group_m 8.

    python scripts/fc1_gather_bench.py [--shapes qwen3-30b-a3b,gpt-oss-20b] [--reps 9]
"""

from __future__ import annotations

import argparse

import torch

from moetrain.bench.moe_layer import SHAPES, forcing_logits
from moetrain.kernels.moe_rows import token_rows
from moetrain.kernels.rowgroup_pingpong import grouped_gemm_fc1_swiglu_pingpong, grouped_gemm_rowgroup_pingpong
from moetrain.kernels.sort_rows import sort_rows
from moetrain.kernels.timing import in_turns, median_ms, relabeled_tokens
from moetrain.kernels.torch_grouped_mm import torch_grouped_mm


WIDE = dict(tile=(64, 256), stages=4)  # the other consumer tile: half the row copies per MMA step
# name -> (fused?, gathered?, options); gathered ones are checked bit for bit against the copy of the same options
VARIANTS = {
    "copy+box": (False, False, {}),
    "copy+box wide": (False, False, WIDE),
    "gather": (False, True, {}),
    "gather cp1": (False, True, dict(cp_warps=1)),
    "gather cp2": (False, True, dict(cp_warps=2)),
    "gather wide": (False, True, WIDE),
    "gather wide cp1": (False, True, dict(cp_warps=1, **WIDE)),
    "gather wide cp2": (False, True, dict(cp_warps=2, **WIDE)),
    "fused copy": (True, False, {}),
    "fused copy wide": (True, False, WIDE),
    "fused gather cp2": (True, True, dict(cp_warps=2)),
    "fused gather wide cp1": (True, True, dict(cp_warps=1, **WIDE)),
}


def contenders(x, w1, offs, token_of_row, inverse, probs):
    def copy():
        return token_rows(x, inverse)

    def one(fused: bool, gathered: bool, options: dict):
        kernel = grouped_gemm_fc1_swiglu_pingpong if fused else grouped_gemm_rowgroup_pingpong
        extra = (probs,) if fused else ()
        if gathered:
            return lambda: kernel(x, w1, offs, *extra, gather_rows=token_of_row, **options)
        return lambda: kernel(copy(), w1, offs, *extra, **{k: v for k, v in options.items() if k != "cp_warps"})

    return {"torch": lambda: torch_grouped_mm("fwd", copy(), w1, offs)} | {
        name: one(*spec) for name, spec in VARIANTS.items()}


def _best(times: dict, fused: bool, gathered: bool) -> float:
    return min(times[n] for n, (f, g, _) in VARIANTS.items() if f == fused and g == gathered)


def _check_bits(runs: dict, what: str) -> None:
    """Every gathered variant gives the bits of the copy with its tile and stages."""
    for name, (fused, gathered, options) in VARIANTS.items():
        if not gathered:
            continue
        twin = next(n for n, (f, g, o) in VARIANTS.items()
                    if f == fused and not g and o.get("tile") == options.get("tile"))
        got, want = runs[name](), runs[twin]()
        got, want = (got, want) if fused else ((got,), (want,))
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise SystemExit(f"{what}: {name} gave other bits than {twin}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b,deepseek-v3,mixtral-8x7b")
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/fc1_gather_bench.py needs a CUDA GPU (Hopper)")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print("ms; 'wide': 64x256 consumer tiles (stages 4), else 128x128 (plain stages 4, fused 5); 'cpN': N of the four "
          "loader warps copy their rows by cp.async, the others by TMA; ratios: the fastest gathered over the fastest "
          "copied")
    names = list(contenders(*[None] * 6))
    print("shape          routing   tokens     " + "".join(f"{n:>22s}" for n in names)
          + "   gather/copy  fused gather/copy")
    for name in a.shapes.split(","):
        s = SHAPES[name]
        x = torch.randn(s.T, s.H, device=dev, dtype=torch.bfloat16, generator=gen)
        w1 = (torch.randn(s.E, 2 * s.I, s.H, device=dev, dtype=torch.bfloat16, generator=gen) / s.H ** 0.5)
        for routing in a.routing.split(","):
            idx = forcing_logits(s, routing, dev).topk(s.K, dim=-1).indices
            offs, _, inverse, token_of_row, probs = sort_rows(idx, s.E, torch.rand(s.T, s.K, device=dev))
            orders = {"own": (token_of_row, inverse), "relabeled": relabeled_tokens(token_of_row, inverse, s.K)}
            for order, (rows, inv) in orders.items():
                runs = contenders(x, w1, offs, rows, inv, probs)
                _check_bits(runs, f"{name} {routing} {order}")
                times, failed = in_turns(list(runs), lambda n: median_ms(runs[n], warmup=1, reps=1), a.reps)
                if failed:
                    raise SystemExit(f"{name}: failed: {failed}")
                print(f"{name:14s} {routing:9s} {order:10s} " + "".join(f"{times[n]:22.3f}" for n in runs)
                      + f"   {_best(times, False, True) / _best(times, False, False):11.3f}"
                      f"  {_best(times, True, True) / _best(times, True, False):17.3f}", flush=True)
        del x, w1
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
