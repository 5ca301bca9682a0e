"""The row kernels' program shapes (kernels/moe_rows.py, route.py, sort_rows.py), swept at the benchmark shapes
against the rule in use and the PyTorch op doing the same job (the peer), in turns, in one process.

    moetrain bench rows [--shapes qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b,deepseek-v3]
                        [--kernels token_rows,combine,swiglu_bwd,swiglu_fwd,route,route_grouped,route_bwd,sort]
                        [--rounds 5] [--json PATH]

Each kernel runs on the inputs the fused layer gives it on bench moe's balanced routing (bf16 rows, the routing
weights as SwiGLU's probs). Every candidate's outputs are first checked against the rule's (bit for bit; sums over
a row that a program shape may order differently to 1e-5), and the rule's against the peer's. Then every candidate,
the rule, the peer and a device copy of the same bytes (the HBM ceiling; memory-bound kernels only) are timed in
turns, each as a CUDA graph of several calls replayed (GPU time only: the launches' host time is not what this
sweeps). Prints per kernel the rule, the peer, the ceiling and the fastest candidates: ms per call, GB/s of the
bytes the kernel must move, and speedup over the rule. A candidate whose outputs differ from the rule's is named and
left out of the timing, and the sweep exits with status 1 at the end. bench/row_kernels.md has the latest results.

route_grouped is DeepSeek-V3's own routing (sigmoid scores with a bias, 8 groups ranked by their two best experts, 4
kept) on the shape's random logits without the benchmark's forcing; the benchmarks' layers route with a plain
softmax top-k.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from moetrain.bench.common import SHAPES, at_least, parse_shapes, require_gpu
from moetrain.errors import UserError

KERNELS = ("token_rows", "combine", "swiglu_bwd", "swiglu_fwd", "route", "route_grouped", "route_bwd", "sort")
# route_grouped's arguments after (logits, K): DeepSeek-V3's (moetrain/config/presets/deepseek-v3.yaml), the bias added below
GROUPED_ROUTING = {"score": "sigmoid", "num_groups": 8, "topk_groups": 4, "group_score": "top2_sum",
                   "scaling_factor": 2.5}
SHOWN = 6  # fastest candidates printed per kernel
DEVICE = "cuda"


def graph_ms(run, calls: int, reps: int = 5) -> float:
    """Median GPU milliseconds per call of ``run()``, from a CUDA graph of ``calls`` calls replayed ``reps`` times
    after one untimed replay (captured after one eager call, which compiles)."""
    from moetrain.runtime.timing import median_ms

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    return median_ms(graph.replay, warmup=1, reps=reps) / calls


def pow2_upto(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


class Inputs:
    """One shape's layer tensors on bench moe's balanced routing: x, the routing (logits, topk idx / weight, the
    sort's outputs), h [M, 2I], da [M, I] bf16."""

    def __init__(self, s):
        from moetrain.bench.moe_layer import forcing_logits
        from moetrain.kernels import route as route_kernels
        from moetrain.kernels import sort_rows as sorting

        gen = torch.Generator(device=DEVICE).manual_seed(0)
        bf = torch.bfloat16
        self.s = s
        self.M = s.T * s.K
        self.x = torch.randn(s.T, s.H, device=DEVICE, generator=gen, dtype=bf)
        # raw: a router's own logits (route_grouped's input; the forcing saturates sigmoid scores into ties)
        self.raw_logits = torch.randn(s.T, s.E, device=DEVICE, generator=gen)
        self.logits = self.raw_logits + forcing_logits(s, "balanced", DEVICE)
        self.idx, self.weight, _, _ = route_kernels.route(self.logits, s.K, "softmax", None, None, "max", None, 1.0,
                                                          True)
        self.dweight = torch.randn(s.T, s.K, device=DEVICE, generator=gen)
        self.offs, self.row_map, self.inverse, self.token_of_row, self.probs = sorting.sort_rows(
            self.idx, s.E, weights=self.weight)
        self.y = torch.randn(self.M, s.H, device=DEVICE, generator=gen, dtype=bf)
        self.h = torch.randn(self.M, 2 * s.I, device=DEVICE, generator=gen, dtype=bf)
        self.da = torch.randn(self.M, s.I, device=DEVICE, generator=gen, dtype=bf)
        self.bias = torch.randn(s.E, device=DEVICE, generator=gen) * 0.1  # route_grouped's expert bias


def kernel_cases(kernel: str, inp: Inputs):
    """(run(candidate) -> outputs, candidates, rule candidate, peer run or None, bytes moved or None, copy bytes,
    graph calls, exact: which outputs must match bit for bit) of one kernel at one shape."""
    from moetrain.kernels import moe_rows
    from moetrain.kernels import route as route_kernels
    from moetrain.kernels import sort_rows as sorting
    from moetrain.kernels.host import cdiv, next_pow2
    from moetrain.ops import moe as moe_ops
    from moetrain.ops import moe_rows as row_ops
    from moetrain.ops.route import topk_weights_backward

    s, M = inp.s, inp.M
    Tile = moe_rows.RowTile
    if kernel in ("token_rows", "combine"):
        cands = [Tile(1, c, w) for c in pow2_upto(1024, min(4096, next_pow2(s.H))) for w in (4, 8)]
        nbytes = (s.T + M) * s.H * 2
        if kernel == "token_rows":
            return (lambda t: (moe_rows.token_rows(inp.x, inp.inverse, tile=t),), cands, moe_rows.combine_tile(s.H),
                    lambda: (inp.x.index_select(0, inp.token_of_row),), nbytes, 4, (0,))
        return (lambda t: (moe_rows.combine(inp.y, inp.inverse, None, s.K, tile=t),), cands,
                moe_rows.combine_tile(s.H), lambda: (row_ops.combine_torch(inp.y, inp.inverse, None, s.K),), nbytes,
                4, (0,))
    if kernel in ("swiglu_bwd", "swiglu_fwd"):
        cands = [Tile(rows, cols, w, steps)
                 for cols in pow2_upto(256, min(1024, next_pow2(s.I))) for elems in (2048, 4096)
                 for w in (4, 8) for steps in sorted({1, cdiv(s.I, cols)})
                 if (rows := elems // cols) >= 1]
        rule = moe_rows.swiglu_tile(s.I)
        if kernel == "swiglu_bwd":
            def peer():
                a = row_ops.swiglu_torch(inp.h, "swiglu")
                dprobs = (inp.da * a).sum(dim=1, dtype=torch.float32)
                return row_ops.swiglu_bwd_torch(inp.h, (inp.da * inp.probs.unsqueeze(1)).to(inp.h.dtype),
                                                "swiglu"), dprobs
            return (lambda t: moe_rows.swiglu_bwd(inp.h, inp.da, "swiglu", inp.probs, tile=t), cands, rule, peer,
                    5 * M * s.I * 2, 2, (0,))
        return (lambda t: (moe_rows.swiglu_fwd(inp.h, "swiglu", inp.probs, tile=t),), cands, rule,
                lambda: ((row_ops.swiglu_torch(inp.h, "swiglu") * inp.probs.unsqueeze(1)).to(inp.h.dtype),),
                3 * M * s.I * 2, 2, (0,))
    if kernel in ("route", "route_grouped", "route_bwd"):
        # up to 16 tokens per program, more where a program of 16 holds few scores (~1024 at most)
        cands = list(itertools.product(pow2_upto(1, max(16, 1024 // next_pow2(s.E))), (1, 2, 4)))
        grouped = kernel == "route_grouped"
        rule = route_kernels._program(next_pow2(s.E), s.T, None, None, kernel == "route_bwd", grouped=grouped)
        if grouped:
            g = GROUPED_ROUTING
            args = (s.K, g["score"], g["num_groups"], g["topk_groups"], g["group_score"], inp.bias,
                    g["scaling_factor"], True)
            return (lambda c: route_kernels.route(inp.raw_logits, *args, tokens_per_program=c[0], warps=c[1])[:3],
                    cands, rule, lambda: _torch_route(inp.raw_logits, s.K, expert_bias=inp.bias, **g), None, 20, (0,))
        if kernel == "route":
            return (lambda c: route_kernels.route(inp.logits, s.K, "softmax", None, None, "max", None, 1.0, True,
                                                  tokens_per_program=c[0], warps=c[1])[:3], cands, rule,
                    lambda: _torch_route(inp.logits, s.K), None, 20, (0,))
        return (lambda c: (route_kernels.route_backward(inp.logits, inp.idx, inp.dweight, "softmax", True, 1.0,
                                                        tokens_per_program=c[0], warps=c[1]),), cands, rule,
                lambda: (topk_weights_backward(inp.logits, inp.idx, inp.dweight, "softmax", True, 1.0),),
                None, 20, ())
    if kernel == "sort":
        cands = [(chunk, sub, w) for chunk in (512, 1024, 2048) for sub in (16, 32, 64) for w in (2, 4)]
        rule = (sorting.chunk_size(M), sorting.SUB, sorting.PLACE_WARPS)
        return (lambda c: sorting.sort_rows(inp.idx, s.E, weights=inp.weight, chunk=c[0], sub=c[1], warps=c[2]),
                cands, rule, lambda: moe_ops.sort_rows(inp.idx, s.E), None, 20, (0, 1, 2, 3, 4))
    raise ValueError(f"unknown row kernel {kernel!r}; known: {', '.join(KERNELS)}")


def _torch_route(logits: torch.Tensor, topk: int, **kw) -> tuple:
    from moetrain.ops.route import route

    r = route(logits, topk, impl="torch", **kw)
    return r.topk_idx, r.topk_weight


def agree(got, want, exact) -> bool:
    for i, (a, b) in enumerate(zip(got, want)):
        if a is None or b is None:
            if (a is None) != (b is None):
                return False
            continue
        if i in exact:
            if not torch.equal(a, b):
                return False
        elif ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item() > 1e-5:
            return False  # sums over a row in another order (d probs over 14336 columns at Mixtral)
    return True


def peer_agrees(kernel: str, got, want) -> bool:
    """The rule's outputs against the peer's (bf16 rows rounded once each way, fp32 sums in another order)."""
    if kernel == "sort":  # the peer gives (offs, row_map) only
        return torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got, want):
        a, b = a.double(), b.double()
        if a.dtype == torch.int64 or not a.is_floating_point():
            if not torch.equal(a, b):
                return False
        elif ((a - b).norm() / b.norm().clamp_min(1e-30)).item() > 1e-2:
            return False
    return True


def sweep_one(kernel: str, inp: Inputs, rounds: int) -> dict:
    from moetrain.runtime.timing import in_turns

    run, cands, rule, peer, nbytes, calls, exact = kernel_cases(kernel, inp)
    if rule not in cands:
        cands.append(rule)
    want = run(rule)
    if peer is not None and not peer_agrees(kernel, [t for t in want], list(peer())):
        raise RuntimeError(f"{inp.s.name} {kernel}: the rule's outputs disagree with the PyTorch peer's")
    bad = [c for c in cands if not agree(run(c), want, exact)]
    if bad:
        print(f"  {inp.s.name} {kernel}: DISAGREE with the rule {label(rule)}, left out: "
              f"{', '.join(map(label, bad))}", flush=True)
        cands = [c for c in cands if c not in bad]
    timed = {("cand", c): (lambda c=c: run(c)) for c in cands}
    if peer is not None:
        timed[("peer", None)] = peer
    if nbytes is not None:
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        timed[("ceiling", None)] = lambda: dst.copy_(src)
    times, failed = in_turns(list(timed), lambda key: graph_ms(timed[key], calls), rounds)
    for key, err in failed.items():
        print(f"  {kernel} {key[1] and label(key[1])}: dropped ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
    return {"rule": rule, "times": times, "bytes": nbytes, "disagree": [label(c) for c in bad]}


def label(candidate) -> str:
    """A program's short name: rows x cols, warps, column steps (RowTile) or its knobs' values."""
    if hasattr(candidate, "cols"):
        return f"{candidate.rows}x{candidate.cols} w{candidate.warps} s{candidate.steps}"
    return "(" + ", ".join(map(str, candidate)) + ")"


def report(name: str, kernel: str, result: dict) -> dict:
    times, rule, nbytes = result["times"], result["rule"], result["bytes"]
    base = times[("cand", rule)]
    best = sorted(((t, c) for (kind, c), t in times.items() if kind == "cand"), key=lambda pair: pair[0])

    def line(label, ms):
        rate = f"{nbytes / ms / 1e6:7.0f}" if nbytes else "      -"
        print(f"  {name:14s} {kernel:10s} {label:34s} {ms:8.4f} {rate} {base / ms:6.3f}x", flush=True)

    line(f"rule {label(rule)}", base)
    for kind in ("peer", "ceiling"):
        if (kind, None) in times:
            line(kind, times[(kind, None)])
    for t, c in best[:SHOWN]:
        line(label(c), t)
    return {"shape": name, "kernel": kernel, "rule": label(rule), "rule_ms": base, "bytes": nbytes,
            "peer_ms": times.get(("peer", None)), "ceiling_ms": times.get(("ceiling", None)),
            "candidates": {label(c): t for t, c in best}, "disagree": result["disagree"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain bench rows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b,deepseek-v3",
                    help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: " + ", ".join(KERNELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write every candidate's time here")
    args = ap.parse_args(argv)
    names = parse_shapes(args.shapes)
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown or not kernels:
        raise UserError(f"--kernels: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(KERNELS)}")
    at_least("--rounds", args.rounds, 1, "round")
    require_gpu("rows")
    print(f"  {'shape':14s} {'kernel':10s} {'program':34s} {'ms':>8s} {'GB/s':>7s} {'x rule':>7s}")
    rows = []
    for name in names:
        inp = Inputs(SHAPES[name])
        for kernel in kernels:
            rows.append(report(name, kernel, sweep_one(kernel, inp, args.rounds)))
        del inp
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(row["disagree"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
