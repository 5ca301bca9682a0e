"""Where the host's time goes in one MoE layer forward + backward (GPU): for ours and the eager reference
of `moetrain bench moe`, the host's wall time to issue one call (no sync inside), the call's GPU time
(CUDA events), and a cProfile of the host side over the timed calls (top functions by own time).

    python scripts/host_profile_moe.py [--shapes qwen3-30b-a3b,deepseek-v3] [--backend auto] [--calls 20]

Why: the profiler timeline of `bench moe --profile` shows the GPU idle ~1.4 ms of Qwen3's 8.5 ms eager call
(20 gaps of 20 us or more) while the six GEMMs' floor has none: this says which host code the GPU waits on.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from moetrain.bench import layer_ab
from moetrain.bench import moe_layer as bench


def _call(fn, args, phase=lambda name: None, lead: bool = True) -> tuple[float, float, torch.cuda.Event,
                                                                          torch.cuda.Event]:
    """One forward + backward as `bench moe` runs it: (host seconds to issue the forward, then the backward; start
    and end events). ``phase("forward")`` / ``phase("backward")`` is called as each begins (host_breakdown.py's
    timers name their pieces by it). A host-ahead contender (bench.HostAhead) first queues its lead-in GEMMs, unless
    ``lead`` is False (the caller queued them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    x, router_w, forcing, w1, w2, K, grad_out = args
    if lead and isinstance(fn, bench.HostAhead):
        fn.lead_in()
    for t in (x, w1, w2):
        t.grad = None
    start.record()
    t0 = time.perf_counter()
    phase("forward")
    out = fn(x, router_w, forcing, w1, w2, K)
    t1 = time.perf_counter()
    phase("backward")
    out.backward(grad_out)
    t2 = time.perf_counter()
    end.record()
    return t1 - t0, t2 - t1, start, end


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b", help=f"comma list of {', '.join(bench.SHAPES)}")
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--queued", action="store_true",
                   help="each call behind ~20 ms of queued GEMMs (bench moe's host-ahead lead-in): the host's hot cost, "
                        "with the GPU busy, instead of each call from an idle GPU")
    p.add_argument("--tokens", type=int, default=None, help="tokens per call (default: the shape's)")
    a = p.parse_args()
    for shape in layer_ab.gpu_shapes(a.shapes, "scripts/host_profile_moe.py"):
        s = bench.shape_at(shape, a.tokens)
        args = bench.layer_inputs(s, "balanced", torch.Generator(device="cuda").manual_seed(0))
        contenders = {f"ours ({a.backend})": bench.ours(a.backend), "reference eager": bench.reference_layer}
        for name, fn in contenders.items():
            if a.queued:
                fn = bench.HostAhead(fn)
            _report(shape, name, fn, args, a.calls, a.top)
        del args
        torch.cuda.empty_cache()


def _report(shape: str, name: str, fn, args, calls: int, top: int) -> None:
    for _ in range(3):  # autotuning, auto's measurement, allocator warm-up
        _call(fn, args)
    torch.cuda.synchronize()
    fwd, bwd, gpus = [], [], []
    for _ in range(calls):  # timed without the profiler (it slows the host)
        f, b, start, end = _call(fn, args)
        end.synchronize()
        fwd.append(f * 1e3)
        bwd.append(b * 1e3)
        gpus.append(start.elapsed_time(end))
    prof = cProfile.Profile()
    for _ in range(calls):
        if isinstance(fn, bench.HostAhead):
            fn.lead_in()  # outside the profile
        prof.enable()
        _call(fn, args, lead=False)
        prof.disable()
        torch.cuda.synchronize()
    print(f"== {shape} {name}: host issue time forward {statistics.median(fwd):.2f} ms + backward "
          f"{statistics.median(bwd):.2f} ms, GPU start->end {statistics.median(gpus):.2f} ms per call "
          f"(medians of {calls}{', each behind queued GEMMs' if isinstance(fn, bench.HostAhead) else ''})",
          flush=True)
    for order, restrict in (("tottime", ()), ("cumulative", ("moetrain",))):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(*restrict, top)
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
        start_at = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
        print(f"-- by {order}" + (f", {restrict[0]} only" if restrict else ""), flush=True)
        print("\n".join(ln[:160] for ln in lines[start_at:]), flush=True)


if __name__ == "__main__":
    main()
