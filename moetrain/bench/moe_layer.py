"""MoE layer forward + backward, route to combine: moetrain's ops against the peers.

    moetrain bench moe [--shapes deepseek-v3,qwen3-30b-a3b] [--backends torch,triton,auto] [--fp8 rowwise]
                       [--json FILE]

Every contender runs in this process on the same inputs, weights and routing, with
repetitions interleaved (contender A, B, C, A, B, C, ...), timed with CUDA events; medians, and "+-%"
half the range of the repetitions over the median (the same contender moved 4-7% between device calls
on the H200: compare within one run).
Contenders:
  ours (<backend>)       router logits as the model computes them (moetrain.ops.router_logits: fp32
                         logits from bf16 tensor-core GEMMs on CUDA), moetrain.ops.route (the fused
                         routing kernel for triton and auto),
                         moetrain.ops.moe_experts with that backend:
                         torch (torch._grouped_mm), triton (the fused path: FC1 gathers token rows,
                         our Triton grouped GEMMs), auto (per-shape choice measured on first use
                         and cached on disk, see moetrain.tuning), reference (loop)
  ours (fp8 R[, unfused]) (--fp8) the expert GEMMs in FP8 recipe R: fused (ops.moe_experts_fp8) or on rows
                         permuted in 16 bits (ops.grouped_gemm_fp8); weights quantized once, as in one step
  reference eager        torchtitan-style: fp32 router + top-k, argsort permutation,
                         torch._grouped_mm FC1/FC2, SwiGLU, index_add_ combine
  reference compiled     the same function under torch.compile
  per-expert loop        the reference with one mm per expert (host-side counts)
  ..., graph (--graphs)  ours and the eager reference captured in one CUDA graph per forward+backward
                         and replayed: GPU time without host launch gaps
  ..., host ahead        (--host-ahead) ours and both references run eagerly as above, but each timed
                         call starts behind HOST_LEAD_MS of queued GPU work (dense GEMMs before the start
                         event), as a layer inside a training step does: the host's launch latency before
                         the first kernels is hidden, while its syncs, allocations and per-kernel gaps still
                         count. The plain rows time each call from an idle GPU (the host's latency counts)
  six torch GEMMs        not a layer: the six grouped GEMMs alone (torch._grouped_mm) on the same
                         routing's group sizes and the same expert weights, timed in turn with the
                         others; "/ GEMMs" = a contender's median time over this floor's (the issue's
                         "within 10% of the GEMM-only time"); "paired" = the median over the rounds of a
                         contender's time over the floor's time in the same round (drift between rounds
                         cancels), "range" the lowest and highest of those rounds' ratios. With
                         --host-ahead also "six torch GEMMs, host ahead", behind the same queued work, and
                         the host-ahead rows are divided by it (an idle GPU runs the next call at other
                         clocks than a busy one: compare like with like)
Before anything is timed every contender runs once (the correctness check) and then --warmup
times: Triton autotuning and auto's measurement happen there, never inside the timed reps.
Routing is forced through the router logits so that all contenders route identically:
balanced (round-robin) or skewed (per-expert shares drawn from a Dirichlet: Dirichlet(0.3), or --routing
skewed:A for Dirichlet(A); each (shape, routing) first prints how uneven its rows per expert are, and its --json
rows carry the same: rows_max_over_mean, rows_cv, empty_experts).
"peak GiB": the most memory a contender's warm-up calls held beyond the inputs, the weights and one set of
gradients (each call frees the previous call's gradients and makes its own).
"mallocs": the caching allocator's cudaMalloc calls and allocation retries (a retry frees cached blocks: a
device sync) during a contender's timed repetitions; nonzero means its time includes them.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M = T*K rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moetrain import ops
from moetrain.bench.common import (ROUTINGS, SHAPES, Shape, at_least, parse_routings, parse_shapes, require_gpu,
                                   shape_at, skew_alpha)
from moetrain.bench.moe_report import (TABLE_HEADER, paired_range, paired_ratio, print_auto_choices, skew_summary,
                                       table_line)
from moetrain.bench.moe_timing import GemmFloor, Graphed, HostAhead, drop_graph, floor_of, fwd_bwd, time_contenders
from moetrain.errors import UserError


def forcing_logits(s: Shape, routing: str, device, seed: int = 0) -> torch.Tensor:
    """[T, E] fp32 added to the router logits so that top-k picks a chosen pattern (routing: see ROUTINGS)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    alpha = skew_alpha(routing)
    if alpha is None:
        t = torch.arange(s.T).unsqueeze(1)
        chosen = (t * s.K + torch.arange(s.K)) % s.E
    else:  # skewed: each token draws K distinct experts from Dirichlet(alpha) shares
        with torch.random.fork_rng(devices=[]):  # Dirichlet draws from the global generator: pin it
            torch.manual_seed(seed)
            shares = torch.distributions.Dirichlet(torch.full((s.E,), alpha)).sample()
        chosen = torch.multinomial(shares.expand(s.T, s.E), s.K, replacement=False, generator=g)
    forcing = torch.zeros(s.T, s.E)
    # Decreasing bonuses keep the order of the K picks stable and dwarf the real logits.
    forcing.scatter_(1, chosen, 100.0 + torch.arange(s.K, 0, -1, dtype=torch.float32).expand(s.T, s.K))
    return forcing.to(device)


def router_logits(x: torch.Tensor, router_w: torch.Tensor, forcing: torch.Tensor) -> torch.Tensor:
    """[T, E] fp32 router logits plus the routing-forcing term (every contender's first step)."""
    return F.linear(x.float(), router_w.float()) + forcing


def route(x: torch.Tensor, router_w: torch.Tensor, forcing: torch.Tensor, K: int):
    """fp32 router: softmax over E, top-k, renormalised weights. x [T, H] -> idx [T, K], w [T, K] fp32."""
    logits = router_logits(x, router_w, forcing)
    weight, idx = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return idx, weight / weight.sum(-1, keepdim=True)


def ours(backend: str):
    """Our layer: ops.router_logits, ops.route and ops.moe_experts as the model's MoE layer runs them
    (see moetrain.models.moe.router): the tensor-core router GEMM except for the reference backend, the
    fused routing kernel with the triton and auto backends, PyTorch routing with torch."""
    from moetrain.runtime.expert_plan import plan_for

    def layer(x, router_w, forcing, w1, w2, K):
        plan = plan_for(x, backend)
        logits = ops.router_logits(x, router_w, impl=plan.logits) + forcing
        r = ops.route(logits, K, impl=plan.routing)
        return ops.moe_experts(x, r.topk_idx, r.topk_weight, w1, w2, backend=backend)
    return layer


def ours_fp8(recipe: str, fused: bool):
    """Our layer with the expert GEMMs in FP8 ``recipe`` (--fp8): routing as ``ours("auto")``, then the fused FP8
    path (ops.moe_experts_fp8: token rows quantized into their permuted rows, FC2 with the combine) or, unfused,
    the rows permuted in 16 bits and ops.grouped_gemm_fp8 on them (what expert parallelism and blockwise run).
    Weights are quantized on the first call and cached, as within one optimizer step."""
    from moetrain.ops.dispatch import combine_rows, permute_tokens
    from moetrain.ops.moe_fp8 import moe_experts_fp8
    from moetrain.runtime.expert_plan import plan_for

    def layer(x, router_w, forcing, w1, w2, K):
        plan = plan_for(x, "auto")
        logits = ops.router_logits(x, router_w, impl=plan.logits) + forcing
        r = ops.route(logits, K, impl=plan.routing)
        if fused:
            return moe_experts_fp8(x, r.topk_idx, r.topk_weight, w1, w2, recipe=recipe)
        p = permute_tokens(x, r.topk_idx, r.topk_weight, w1.shape[0], "triton")
        h = ops.grouped_gemm(p.rows, w1, p.offs, recipe=recipe)
        y = ops.grouped_gemm(ops.swiglu(h, "swiglu", probs=p.probs, impl="triton"), w2, p.offs, recipe=recipe)
        return combine_rows(y, p.inverse, K, None, "triton")
    return layer


def fp8_contenders(recipes: list[str]) -> dict:
    """--fp8's contenders: each recipe unfused, and fused where ops.moe_experts_fp8 runs it."""
    from moetrain.config.schema import FP8_FUSED

    out = {}
    for recipe in recipes:
        if recipe in FP8_FUSED:
            out[f"ours (fp8 {recipe})"] = ours_fp8(recipe, fused=True)
        out[f"ours (fp8 {recipe}, unfused)"] = ours_fp8(recipe, fused=False)
    return out


def reference_layer(x, router_w, forcing, w1, w2, K, per_expert_loop: bool = False):
    """torchtitan-style MoE layer written out in plain torch."""
    T, H = x.shape
    E = w1.shape[0]
    idx, weight = route(x, router_w, forcing, K)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token_of_row = order // K
    xs = x[token_of_row]
    if per_expert_loop:
        # one split of the rows and one unbind of each weight (each backward is one cat / stack), not an index
        # per expert: each indexed piece's backward writes a zeroed gradient of the whole tensor (w1 alone is
        # 15 GB at DeepSeek-V3), which took the loop to ~6 s per call there
        pieces = []
        for rows, w1_e, w2_e in zip(xs.split(counts.tolist()), w1.unbind(0), w2.unbind(0)):
            h = rows @ w1_e.t()
            g, u = h.chunk(2, dim=-1)
            pieces.append((F.silu(g) * u) @ w2_e.t())
        ys = torch.cat(pieces)
    else:
        h = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, dim=-1)
        ys = torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)
    ys = ys * weight.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
    out = torch.zeros(T, H, device=x.device, dtype=ys.dtype)
    return out.index_add_(0, token_of_row, ys)


def layer_inputs(s: Shape, routing: str, gen: torch.Generator) -> tuple:
    """One contender call's inputs on gen's device: (x [T, H] bf16 with grad, router_w [E, H] bf16, forcing [T, E]
    fp32, w1 [E, 2I, H], w2 [E, H, I] bf16 with grad, K, grad_out [T, H] bf16); each call draws new values."""
    dev, bf = gen.device, torch.bfloat16
    # drawn in bf16: an fp32 draw of DeepSeek-V3's w1 is a 30 GB transient (it ran out of memory beside
    # the graphed contenders' pools)
    x = torch.randn(s.T, s.H, device=dev, generator=gen, dtype=bf).requires_grad_()
    # bf16 like the model's router weight after model.to(bf16): ours then takes the tensor-core logits
    # GEMM as training does; the reference upcasts it to fp32
    router_w = torch.randn(s.E, s.H, device=dev, generator=gen, dtype=bf).mul_(0.02)
    w1 = torch.randn(s.E, 2 * s.I, s.H, device=dev, generator=gen, dtype=bf).div_(s.H**0.5).requires_grad_()
    w2 = torch.randn(s.E, s.H, s.I, device=dev, generator=gen, dtype=bf).div_(s.I**0.5).requires_grad_()
    grad_out = torch.randn(s.T, s.H, device=dev, generator=gen, dtype=bf)
    return x, router_w, forcing_logits(s, routing, dev), w1, w2, s.K, grad_out


def layer_flops(s: Shape) -> float:
    """FLOPs of the six expert GEMMs (FC1/FC2 forward, data and weight gradients)."""
    M = s.T * s.K
    return 3 * (2 * M * s.H * 2 * s.I + 2 * M * s.I * s.H)


def print_kernel_profile(s: Shape, routing: str, contenders: dict, make_args, calls: int = 2, top: int = 14) -> None:
    """Each contender's CUDA kernels by total time, per forward+backward call, and one call's timeline (GPU busy
    and idle time, the largest idle gaps, allocations and synchronisations: moetrain.bench.gpu_timeline)."""
    from moetrain.bench.gpu_timeline import describe, kernel_totals, profile_calls

    args = make_args()
    for name, fn in contenders.items():
        if name == "per-expert loop" or isinstance(fn, (Graphed, GemmFloor, HostAhead)):  # its eager twin's kernels
            continue
        timelines = profile_calls(lambda fn=fn: fwd_bwd(fn, args), calls=calls)  # one profiled run serves both
        kernels = sorted(kernel_totals(timelines).items(), key=lambda kv: -kv[1][1])
        total = sum(us for _, (_, us) in kernels) / 1e3
        print(f"  [{s.name} {routing}] {name}: {total:.2f} ms of kernels per call", flush=True)
        for kernel, (count, us) in kernels[:top]:
            print(f"    {us / 1e3:7.3f} ms  x{round(count):<3d} {kernel[:90]}", flush=True)
        # the last call's timeline (the first may still allocate): what of the wall time is not kernels
        print(f"    timeline: {describe(timelines[-1])}", flush=True)


def check_correct(contenders: dict, make_args) -> dict:
    """Relative error of each contender's output and input gradient against the eager reference."""
    args = make_args()
    ref_out = None
    errors = {}
    for name, fn in list(contenders.items()):
        x, router_w, forcing, w1, w2, K, grad_out = args
        if floor_of(fn) is not None:  # not a layer: nothing to compare
            errors[name] = float("nan")
            continue
        if isinstance(fn, Graphed):  # captured on these inputs, replayed once more
            try:
                fn.replay(args)
            except torch.OutOfMemoryError:
                drop_graph(contenders, name)
                continue
            got = (fn.out.detach().float(), fn.grads[0].float().clone())
            # captured again on the timing's inputs: its pool (DeepSeek-V3: the layer's peak plus 22 GB of weight
            # gradients) must not outlive the check, or the graphs' pools and the timing's inputs do not fit together
            fn.release()
            torch.cuda.empty_cache()
        else:
            x.grad = w1.grad = w2.grad = None  # only dx is compared: no weight gradients kept across contenders
            out = fn(x, router_w, forcing, w1, w2, K)
            out.backward(grad_out)
            got = (out.detach().float(), x.grad.float().clone())
        if ref_out is None:
            ref_out = got
        errors[name] = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref_out))
    return errors


def run_shape(s: Shape, routing: str, backends: list[str], warmup: int, reps: int, compile_ref: bool,
              profile: bool = False, graphs: bool = False, host_ahead: bool = False,
              fp8: list[str] | None = None) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make_args():
        return layer_inputs(s, routing, gen)

    started = time.perf_counter()

    def progress(what: str) -> None:  # long phases (compiling, autotuning, the per-expert loop) say where they are
        print(f"    [{s.name} {routing}, {time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    contenders = {"reference eager": reference_layer}
    if compile_ref:
        progress("compiling the reference")
        compiled = torch.compile(reference_layer)
        try:
            compiled(*make_args()[:6]).float().sum().backward()
            contenders["reference compiled"] = compiled
        except Exception as err:  # reported, not hidden: the table then lacks this row
            print(f"    reference compiled failed on {s.name}: {type(err).__name__}: {err}"[:300], flush=True)
    for backend in backends:
        contenders[f"ours ({backend})"] = ours(backend)
    contenders.update(fp8_contenders(fp8 or []))
    contenders["per-expert loop"] = lambda *a: reference_layer(*a, per_expert_loop=True)
    if host_ahead:  # the same eager layers, each call behind queued GPU work (see HostAhead)
        for name in [n for n in contenders if n.startswith(("ours", "reference"))]:
            contenders[f"{name}, host ahead"] = HostAhead(contenders[name])
    if graphs:  # both sides without host gaps: ours and the eager reference, each from one CUDA graph
        contenders["reference, graph"] = Graphed(reference_layer)
        for backend in backends:
            contenders[f"ours ({backend}), graph"] = Graphed(ours(backend))
    contenders[FLOOR] = GemmFloor(lambda w1, w2: six_gemms(s, routing, w1.device, w1.dtype, weights=(w1, w2)))
    if host_ahead:  # the floor behind the same queued work: host-ahead rows are divided by it (the same GPU state)
        contenders[f"{FLOOR}, host ahead"] = HostAhead(contenders[FLOOR])
    # The first call of each contender (here) autotunes the Triton kernels and makes auto measure
    # and cache its choice for this shape; time_contenders then warms up again before timing.
    progress(f"first call of {len(contenders)} contenders (autotuning, checking outputs)")
    errors = check_correct(contenders, make_args)
    progress("timing")
    timed = time_contenders(contenders, make_args, warmup, reps)
    progress("done")
    if profile:
        print_kernel_profile(s, routing, contenders, make_args)
    return table_rows(s, routing, timed, errors, contenders)


def table_rows(s: Shape, routing: str, timed: dict, errors: dict, contenders: dict) -> list[dict]:
    """bench moe's rows (one dict per contender) from time_contenders' results and check_correct's errors."""
    flops = layer_flops(s)
    ref_ms = timed["reference eager"][0]
    ahead_floor = f"{FLOOR}, host ahead"
    rows = []
    for name, (ms, peak, spread, alloc_events, reps_ms) in timed.items():
        # host-ahead rows against the host-ahead reference and floor (all without the host's latency, behind the same
        # queued GEMMs: a GPU that idled before a call runs it at higher clocks), the rest against the reference
        # and floor timed from an idle GPU
        ahead = name.endswith("host ahead")
        ref = timed.get("reference eager, host ahead", (ref_ms,))[0] if ahead else ref_ms
        floor_name = ahead_floor if ahead and ahead_floor in timed else FLOOR
        floor = timed[floor_name][0]
        # a replayed graph allocates nothing (its memory was taken at capture): no peak to report
        no_peak = name.startswith(FLOOR) or isinstance(contenders.get(name), Graphed)
        rows.append({"shape": s.name, "tokens": s.T, "routing": routing, "contender": name, "ms": ms,
                     "spread_pct": spread,
                     "tflops": flops / ms / 1e9, "peak_gib": float("nan") if no_peak else peak,
                     "vs_eager": ref / ms, "vs_gemms": ms / floor,
                     "vs_gemms_paired": paired_ratio(reps_ms, timed[floor_name][4]),
                     "paired_range": paired_range(reps_ms, timed[floor_name][4]), "rel_err": errors[name],
                     "alloc_events": alloc_events, "reps_ms": reps_ms})
    return rows


FLOOR = "six torch GEMMs"


def routed_rows(s: Shape, routing: str, device) -> torch.Tensor:
    """[E] int64 rows per expert of this routing (the same top-k picks the contenders make)."""
    chosen = forcing_logits(s, routing, device).topk(s.K, dim=-1).indices.flatten()
    return torch.bincount(chosen, minlength=s.E)


def routed_offs(s: Shape, routing: str, device) -> torch.Tensor:
    """[E] int32 group ends of this routing (routed_rows, summed up)."""
    return torch.cumsum(routed_rows(s, routing, device), 0).to(torch.int32)


def routing_stats(s: Shape, routing: str) -> dict:
    """How uneven a routing's rows per expert are: the largest over the mean, their coefficient of variation and the
    experts left without rows (balanced: 1.0, 0.0 and none when E divides T*K)."""
    rows = routed_rows(s, routing, "cpu").double()
    return {"rows_max_over_mean": (rows.max() / rows.mean()).item(),
            "rows_cv": (rows.std(correction=0) / rows.mean()).item(), "empty_experts": int((rows == 0).sum())}


def routing_line(s: Shape, routing: str, stats: dict) -> str:
    """routing_stats(s, routing) as the line bench moe prints before a (shape, routing)'s rows."""
    return (f"  {s.name} {routing}: rows per expert max / mean {stats['rows_max_over_mean']:.2f}, "
            f"CV {stats['rows_cv']:.2f}, {stats['empty_experts']} of {s.E} experts empty")


def six_gemms(s: Shape, routing: str, device, dtype=torch.bfloat16, weights=None):
    """A callable running the layer's six grouped GEMMs alone (torch._grouped_mm: FC1/FC2 forward, data
    and weight gradients) on random operands with this routing's group sizes, returning their outputs:
    the floor the whole layer is compared with. weights: (w1 [E, 2I, H], w2 [E, H, I]) to use instead of
    drawing new ones (the benchmark passes the contenders' own)."""
    gen = torch.Generator(device=device).manual_seed(1)
    M = s.T * s.K
    offs = routed_offs(s, routing, device)

    def rand(*shape):  # drawn in dtype: an fp32 draw of DeepSeek-V3's w1 alone would be 30 GB
        return torch.randn(*shape, device=device, generator=gen, dtype=dtype)

    x, a, dy, dh = rand(M, s.H), rand(M, s.I), rand(M, s.H), rand(M, 2 * s.I)
    w1, w2 = weights if weights is not None else (rand(s.E, 2 * s.I, s.H) / s.H**0.5, rand(s.E, s.H, s.I) / s.I**0.5)

    gemms = (lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),  # FC1 forward  [M, 2I]
             lambda: torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs),  # FC2 forward  [M, H]
             lambda: torch._grouped_mm(dy, w2, offs=offs),  # FC2 data gradient [M, I]
             lambda: torch._grouped_mm(dy.t(), a, offs=offs),  # FC2 weight gradient [E, H, I]
             lambda: torch._grouped_mm(dh, w1, offs=offs),  # FC1 data gradient [M, H]
             lambda: torch._grouped_mm(dh.t(), x, offs=offs))  # FC1 weight gradient [E, 2I, H]

    def six(keep: bool = True):
        """The six outputs, or (keep=False, timing) None: each freed before the next is allocated, so the floor
        holds one output at a time (DeepSeek-V3's six are 25 GB; all at once ran out beside graphed layers)."""
        if keep:
            return tuple(gemm() for gemm in gemms)
        for gemm in gemms:
            gemm()
        return None

    six.operands = (x, a, dy, dh, w1, w2, offs)
    return six


def parse_backends(text: str, device: torch.device) -> list[str]:
    """Comma list of moetrain.ops backends -> names; unknown names and a missing triton are UserErrors."""
    names = [b.strip() for b in text.split(",") if b.strip()]
    for name in names:
        try:
            ops.resolve_backend(name, device)
        except ValueError as err:
            raise UserError(str(err)) from None
    return names


def parse_fp8_recipes(text: str) -> list[str]:
    """--fp8's comma list -> recipes with GPU kernels; another name is a UserError naming the valid ones."""
    valid = ("rowwise", "tensorwise", "blockwise")
    names = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in names if r not in valid]
    if bad:
        raise UserError(f"--fp8 {', '.join(bad)}: not an FP8 recipe with GPU kernels; valid: {', '.join(valid)}")
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="moetrain bench moe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--routing", default="balanced,skewed", help="comma-separated: " + ROUTINGS)
    parser.add_argument("--backends", default="torch",
                        help="moetrain.ops backends to include, comma-separated: torch, triton, auto, reference")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--graphs", action="store_true",
                        help="also time ours and the eager reference replayed from one CUDA graph each (no host gaps)")
    parser.add_argument("--host-ahead", action="store_true",
                        help="also time ours and the references eagerly behind queued GPU work (host latency hidden)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, print each contender's top CUDA kernels (torch.profiler)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per layer call for every shape instead of its own T (e.g. your micro-batch's "
                             "tokens per GPU: with fewer, the GPU's time shrinks and the host's does not)")
    parser.add_argument("--fp8", default="", help="also our layer with the expert GEMMs in these FP8 recipes, "
                        "comma-separated (rowwise, tensorwise: fused and unfused; blockwise: unfused)")
    args = parser.parse_args(argv)
    fp8 = parse_fp8_recipes(args.fp8)
    names = parse_shapes(args.shapes)  # the arguments first: a typo is reported on a machine without a GPU too
    routings = parse_routings(args.routing)
    at_least("--tokens", args.tokens, 1, "token per layer call")
    shapes = [shape_at(n, args.tokens) for n in names]
    require_gpu("moe")
    backends = parse_backends(args.backends, torch.device("cuda"))
    tokens = "" if args.tokens is None else f"; {args.tokens} tokens per call at every shape"
    print(f"MoE layer fwd+bwd, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"TFLOP/s counts the six expert GEMMs{tokens}", flush=True)
    print(TABLE_HEADER, flush=True)
    rows = []
    for shape in shapes:
        for routing in routings:
            unevenness = routing_stats(shape, routing)
            print(routing_line(shape, routing, unevenness), flush=True)
            new = run_shape(shape, routing, backends, args.warmup, args.reps,
                            not args.no_compile, args.profile, args.graphs, args.host_ahead, fp8)
            for r in new:  # printed and saved per shape, so a run cut short keeps what it measured
                r.update(unevenness)
                print(table_line(r), flush=True)
            rows += new
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
            torch.cuda.empty_cache()
    for line in skew_summary(rows):
        print(line, flush=True)
    if "auto" in backends:
        print_auto_choices()


if __name__ == "__main__":
    main()
