"""Timing the MoE layer's contenders (``moetrain bench moe``): interleaved forward + backward repetitions with CUDA
events, and the wrappers a contender can be: the six-GEMM floor, a call queued behind GPU work (host ahead), a CUDA
graph replay. Every contender is called as ``fn(x, router_w, forcing, w1, w2, K)`` and returns the layer's output.
"""

from __future__ import annotations

import statistics

import torch


def time_contenders(contenders: dict, make_args, warmup: int, reps: int) -> dict:
    """Interleaved timing of forward + backward; returns name -> (median ms, peak GiB, spread %, allocator events,
    every repetition's ms in order).
    Allocator events: cudaMalloc calls and allocation retries (each retry frees cached blocks: a device sync) of
    the caching allocator inside the timed repetitions: a nonzero count means the time includes them."""
    peaks = {}
    args = make_args()
    for name, fn in list(contenders.items()):  # warm-up and peak memory, one contender at a time
        try:
            # One call before the baseline, so that every contender's baseline holds one set of gradients (x, w1,
            # w2: its own), which each call frees and makes again. Without it the first contender's peak counted
            # the gradients (22 GB at DeepSeek-V3) and the others' did not.
            fwd_bwd(fn, args)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            for _ in range(warmup):
                fwd_bwd(fn, args)
        except torch.OutOfMemoryError:
            if not isinstance(fn, Graphed):
                raise
            drop_graph(contenders, name)
            continue
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    results = {name: [] for name in contenders}
    events = dict.fromkeys(contenders, 0)
    for _ in range(reps):
        for name, fn in contenders.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before = _allocator_events()
            if isinstance(fn, HostAhead):
                fn.lead_in()
            start.record()
            fwd_bwd(fn, args)
            end.record()
            end.synchronize()
            results[name].append(start.elapsed_time(end))
            events[name] += _allocator_events() - before
    out = {}
    for name, t in results.items():
        med = statistics.median(t)
        # spread: half the range of the repetitions over their median, in % (how far one number can be trusted)
        out[name] = (med, peaks[name], 50 * (max(t) - min(t)) / med, events[name], t)
    return out


def _allocator_events() -> int:
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0) + stats.get("num_alloc_retries", 0)


def floor_of(fn) -> GemmFloor | None:
    """The six-GEMM floor a contender runs (itself, or behind queued work), else None: not a layer."""
    inner = fn.fn if isinstance(fn, HostAhead) else fn
    return inner if isinstance(inner, GemmFloor) else None


def fwd_bwd(fn, args):
    fn = floor_of(fn) or fn  # (a host-ahead floor's lead-in is queued by time_contenders)
    if isinstance(fn, (Graphed, GemmFloor)):
        fn.replay(args)
        return
    x, router_w, forcing, w1, w2, K, grad_out = args
    for t in (x, w1, w2):
        t.grad = None
    fn(x, router_w, forcing, w1, w2, K).backward(grad_out)


class GemmFloor:
    """The six grouped GEMMs alone on a shape's routing, with the contenders' own expert weights: timed in turn with
    the contenders (the same GPU state), not after them. ``make_run(w1, w2)`` builds the runnable
    (``moe_layer.six_gemms`` on those weights)."""

    def __init__(self, make_run):
        self.make_run, self.run, self.args = make_run, None, None

    def replay(self, args) -> None:
        if args is not self.args:
            self.run = self.make_run(args[3].detach(), args[4].detach())
            self.args = args
        self.run(keep=False)


HOST_LEAD_MS = 20.0  # GPU work queued before a host-ahead call: more than a layer's whole host time


LEAD_GEMM = 8192  # the queued work: square bf16 GEMMs of this size (~1.5 ms each on an H200)


class HostAhead:
    """A contender run eagerly, each timed call queued behind ~HOST_LEAD_MS of GPU work (``lead_in``, before the
    start event): the host has issued the call's first launches before the GPU reaches them, as inside a
    training step where earlier layers keep the GPU busy; its syncs, allocations and per-kernel gaps still count.
    The queued work is dense GEMMs, not a sleep: behind an idle lead-in the GPU's clocks recover from the power
    cap, and the big layers time 3-11% fast (Mixtral under its own six GEMMs; bench/method.md)."""

    _lead: tuple | None = None  # (a, b, out, GEMMs per lead-in), shared by every host-ahead contender

    def __init__(self, fn):
        self.fn = fn
        if HostAhead._lead is None:  # made before any baseline is taken: in no contender's peak or timed reps
            from moetrain.runtime.timing import median_ms

            a, b, out = (torch.randn(LEAD_GEMM, LEAD_GEMM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            gemm_ms = median_ms(lambda: torch.mm(a, b, out=out), warmup=1, reps=4)
            HostAhead._lead = (a, b, out, max(1, round(HOST_LEAD_MS / gemm_ms)))

    def __call__(self, *args):
        return self.fn(*args)

    def lead_in(self) -> None:
        a, b, out, count = HostAhead._lead
        for _ in range(count):
            torch.mm(a, b, out=out)


class Graphed:
    """A contender's whole forward + backward captured once in a CUDA graph and replayed: the layer's
    GPU time without the host's launch gaps (what CUDA graphs would buy; the trainer does not use them
    yet). Captured on the inputs of its first call, again when called with other inputs. Needs a sync-free
    layer (ours and the torchtitan-style reference are; the per-expert loop is not)."""

    def __init__(self, fn):
        self.fn, self.graph, self.args, self.out, self.grads = fn, None, None, None, None

    def replay(self, args) -> None:
        if args is not self.args:  # new inputs (each phase of the benchmark makes its own): capture again
            self.release()
            self._capture(args)
        self.graph.replay()

    def release(self) -> None:
        """Drop the graph, its outputs and gradients (the graph's private memory pool goes with them)."""
        self.graph = self.out = self.grads = self.args = None

    def _capture(self, args) -> None:
        self.args = args
        from moetrain.train.graphed_step import on_side_stream

        x, router_w, forcing, w1, w2, K, grad_out = args

        def warm_up():  # off the capture stream (caches, autotuning, allocator)
            # the graph's own leaves (same storage), first used here: a leaf's gradient accumulator runs on the
            # stream of its first use, and one made on the legacy default stream (the caller's eager runs)
            # cannot join a capture
            leaves = tuple(t.detach().requires_grad_() for t in (x, w1, w2))
            for _ in range(2):
                fwd_bwd(self.fn, (leaves[0], router_w, forcing, leaves[1], leaves[2], K, grad_out))
            return leaves

        x, w1, w2 = on_side_stream(warm_up, x.device)
        for t in (x, w1, w2):
            t.grad = None  # the gradients the graph writes live in its own pool, kept by the tensors below
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.fn(x, router_w, forcing, w1, w2, K)
            self.out.backward(grad_out)
        self.grads = (x.grad, w1.grad, w2.grad)


def drop_graph(contenders: dict, name: str) -> None:
    """A graphed contender that ran out of memory at capture: its private pool keeps the layer's weight
    gradients (DeepSeek-V3: 22 GB) beside the other graphs' pools. Left out of the table, said so."""
    contenders.pop(name).release()
    torch.cuda.empty_cache()
    print(f"    {name}: out of GPU memory capturing the graph, left out of this shape's table "
          "(fewer --backends, or no --graphs, at this shape)", flush=True)
