"""Where the host's time goes in one MoE layer forward + backward (GPU): for ours and the eager reference
of `moetrain bench moe`, the host's wall time to issue one call (no sync inside), the call's GPU time
(CUDA events), and a cProfile of the host side over the timed calls (top functions by own time).

    python scripts/host_profile_moe.py [--shape qwen3-30b-a3b] [--backend auto] [--calls 20]

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

from moetrain.bench import moe_layer as bench


def _call(fn, args) -> tuple[float, torch.cuda.Event, torch.cuda.Event]:
    """One forward + backward as `bench moe` runs it: (host seconds to issue it, start and end events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    bench._fwd_bwd(fn, args)
    host = time.perf_counter() - t0
    end.record()
    return host, start, end


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(bench.SHAPES))
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    s = bench.SHAPES[a.shape]
    args = bench.layer_inputs(s, "balanced", torch.Generator(device="cuda").manual_seed(0))
    contenders = {f"ours ({a.backend})": bench.ours(a.backend), "reference eager": bench.reference_layer}
    for name, fn in contenders.items():
        for _ in range(3):  # autotuning, auto's measurement, allocator warm-up
            _call(fn, args)
        torch.cuda.synchronize()
        hosts, gpus = [], []
        for _ in range(a.calls):  # timed without the profiler (it slows the host)
            host, start, end = _call(fn, args)
            end.synchronize()
            hosts.append(host * 1e3)
            gpus.append(start.elapsed_time(end))
        prof = cProfile.Profile()
        for _ in range(a.calls):
            prof.enable()
            _call(fn, args)
            prof.disable()
            torch.cuda.synchronize()
        print(f"== {a.shape} {name}: host issue time {statistics.median(hosts):.2f} ms, "
              f"GPU start->end {statistics.median(gpus):.2f} ms per call (medians of {a.calls})", flush=True)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
        start_at = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
        print("\n".join(ln[:160] for ln in lines[start_at:]), flush=True)


if __name__ == "__main__":
    main()
