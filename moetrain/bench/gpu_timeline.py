"""Where a call's wall time goes besides kernels: GPU busy time (the union of kernel intervals), the idle
gaps between kernels, and the CUDA runtime calls that can open them (allocations, synchronisations).

``bench moe --profile`` prints this per contender: at Mixtral the layer's wall time was ~5 ms longer than
its kernels (bench/archive/2026-11-29_1205-1455.md), which kernel totals alone cannot explain.

Times are microseconds on the profiler's clock (torch.profiler puts CPU ranges and GPU kernels on one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# runtime calls that can leave the GPU idle: the host blocks in them, or they wait for the device
RUNTIME_CALLS = ("cudaMalloc", "cudaFree", "cudaDeviceSynchronize", "cudaStreamSynchronize",
                 "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaHostAlloc")


@dataclass
class CallTimeline:
    wall_us: float  # from the call's start (host) to its last kernel's end
    busy_us: float  # union of kernel intervals
    first_kernel_us: float  # from the call's start to its first kernel
    gaps: list[tuple[float, str]] = field(default_factory=list)  # (idle us, the kernel after it), largest first
    runtime: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (count, host us)
    kernels: dict[str, tuple[int, float]] = field(default_factory=dict)  # kernel name -> (count, GPU us)

    @property
    def idle_us(self) -> float:
        return self.wall_us - self.busy_us


def timeline(start_us: float, kernels: list[tuple[float, float, str]], min_gap_us: float = 20.0) -> CallTimeline:
    """Busy time and idle gaps of kernels [(start, end, name)] of one call that began at ``start_us``.
    Overlapping kernels (several streams) count once; gaps shorter than ``min_gap_us`` are not listed."""
    if not kernels:
        return CallTimeline(0.0, 0.0, 0.0)
    kernels = sorted(kernels)
    busy, gaps = 0.0, []
    run_start, run_end = kernels[0][0], kernels[0][1]
    for s, e, name in kernels[1:]:
        if s > run_end:
            busy += run_end - run_start
            if s - run_end >= min_gap_us:
                gaps.append((s - run_end, name))
            run_start, run_end = s, e
        else:
            run_end = max(run_end, e)
    busy += run_end - run_start
    last = max(e for _, e, _ in kernels)
    return CallTimeline(wall_us=last - start_us, busy_us=busy, first_kernel_us=kernels[0][0] - start_us,
                        gaps=sorted(gaps, reverse=True), kernels=_tally((name, e - s) for s, e, name in kernels))


def _tally(items) -> dict[str, tuple[int, float]]:
    """name -> (count, total) of (name, amount) pairs."""
    out: dict[str, tuple[int, float]] = {}
    for name, amount in items:
        n, t = out.get(name, (0, 0.0))
        out[name] = (n + 1, t + amount)
    return out


def kernel_totals(calls: list[CallTimeline]) -> dict[str, tuple[float, float]]:
    """kernel name -> (launches, GPU us) per call, averaged over ``calls``."""
    merged: dict[str, tuple[float, float]] = {}
    for call in calls:
        for name, (n, t) in call.kernels.items():
            count, total = merged.get(name, (0.0, 0.0))
            merged[name] = (count + n / len(calls), total + t / len(calls))
    return merged


def profile_calls(run, calls: int = 2) -> list[CallTimeline]:
    """Profile ``run()`` ``calls`` times (CPU + CUDA activity, a device sync after each) and return each call's
    timeline with the runtime calls made inside it."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            with record_function(f"call {i}"):
                run()
                torch.cuda.synchronize()
    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events if e.name.startswith("call ")
                    and e.device_type == DeviceType.CPU)
    out = []
    for start, end in ranges:
        inside = [e for e in events if start <= e.time_range.start <= end]
        # GPU-side events are the kernels, memcpys / memsets, and (newer torch) our own "call i" range mirrored
        # onto the GPU as an annotation spanning the call: not a kernel
        kernels = [(e.time_range.start, e.time_range.end, e.name) for e in inside
                   if e.device_type == DeviceType.CUDA and not e.name.startswith("call ")]
        call = timeline(start, kernels)
        call.runtime = _tally((e.name, e.time_range.end - e.time_range.start) for e in inside
                              if e.device_type == DeviceType.CPU and e.name in RUNTIME_CALLS)
        out.append(call)
    return out


def describe(call: CallTimeline, top: int = 4) -> str:
    """One line: busy / idle / first kernel, the largest gaps, the runtime calls."""
    gaps = ", ".join(f"{g / 1e3:.2f} ms before {name[:40]}" for g, name in call.gaps[:top]) or "none"
    runtime = ", ".join(f"{name} x{n} ({t / 1e3:.2f} ms)" for name, (n, t) in sorted(call.runtime.items())) or "none"
    return (f"wall {call.wall_us / 1e3:.2f} ms = busy {call.busy_us / 1e3:.2f} + idle {call.idle_us / 1e3:.2f} "
            f"(first kernel after {call.first_kernel_us / 1e3:.2f}); gaps >= 20 us: {len(call.gaps)}, largest: "
            f"{gaps}; runtime calls: {runtime}")
