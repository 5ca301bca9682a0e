"""Host time of each piece of our eager MoE layer call (forward, then backward), on the GPU host, without a profiler:
chosen functions are wrapped with a wall-clock timer (inclusive of what they call; ~1 us per wrapped call), every
Triton / Gluon launch is timed per kernel, and torch._grouped_mm per call.

    python scripts/host_breakdown.py [--shapes gpt-oss-20b,qwen3-30b-a3b] [--backend auto] [--calls 20] [--tokens N]
                                     [--queued] [--launches direct,triton]

Why: in an eager call the GPU waits whenever the host issues slower than the GPU runs (session 15, call A: at Qwen3
our forward takes 2.2 ms of host time and the backward 4.0 ms, against 1.1 and 1.5 for the eager reference, for a
GPU time of 8 ms). cProfile's per-call overhead distorts small functions; this times only the listed ones.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import sys
import time

import torch

from host_profile_moe import _call  # (this folder)

from moetrain.bench import layer_ab
from moetrain.bench import moe_layer as bench
from moetrain.kernels import launch as kernel_launch

# "module:function"; nested entries report inclusive time (their callers include them)
WRAPPED = (
    "moetrain.ops.router_gemm:router_logits",
    "moetrain.ops.route:route",
    "moetrain.ops.moe:moe_experts",
    "moetrain.kernels.sort_rows:sort_rows",
    "moetrain.ops.moe:_live_weight",
    "moetrain.kernels.sort_rows:routing_weight_grad",
    "moetrain.ops.moe_fused:fc1_swiglu",
    "moetrain.ops.moe_fused:_fused_forward",
    "moetrain.kernels.rowgroup_pingpong:grouped_gemm_fc1_swiglu_pingpong",
    "moetrain.ops.grouped_gemm:grouped_gemm_op",
    "moetrain.ops.moe_rows:combine",
    "moetrain.ops.moe_rows:swiglu_backward",
    "moetrain.kernels.route:route_backward",
    "moetrain.ops.moe_fused:_fc1_backward",
    "moetrain.ops.autoselect:choose",
    "moetrain.kernels.grouped_gemm_tuning:pick_config",
    "moetrain.kernels.gluon_descs:descriptor",
)


class Timers:
    def __init__(self):
        self.total = collections.defaultdict(float)  # name -> seconds
        self.calls = collections.Counter()
        self.active = collections.Counter()  # recursion: only the outermost call counts
        self.phase = ""  # "forward" or "backward": part of every name

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if self.active[name]:
                return fn(*args, **kwargs)
            self.active[name] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)
                self.active[name] -= 1
        return timed

    def add(self, name: str, seconds: float) -> None:
        key = f"{self.phase}: {name}"
        self.total[key] += seconds
        self.calls[key] += 1

    def reset(self):
        self.total.clear()
        self.calls.clear()


def install_wrappers(wrap) -> None:
    """Replace each WRAPPED function (in every module that imported it by name), torch._grouped_mm and every Triton /
    Gluon launch (kernels.launch.launch and JITFunction.run, named "launch KERNEL") by ``wrap(name, fn)``."""
    for spec in WRAPPED:
        modname, attr = spec.split(":")
        orig = getattr(importlib.import_module(modname), attr)
        wrapped = wrap(attr, orig)
        for m in list(sys.modules.values()):
            if m is not None and getattr(m, attr, None) is orig:
                setattr(m, attr, wrapped)
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    direct = kernel_launch.launch
    inside = []  # a direct launch's first call goes through JITFunction.run: counted once, as the launch

    def wrapped_run(self, *args, **kwargs):
        if inside:
            return run(self, *args, **kwargs)
        return wrap("launch " + self.fn.__name__, lambda: run(self, *args, **kwargs))()

    def wrapped_launch(kernel, grid, *args, **kwargs):
        def call():
            inside.append(1)
            try:
                return direct(kernel, grid, *args, **kwargs)
            finally:
                inside.pop()
        return wrap("launch " + kernel.__name__, call)()
    JITFunction.run = wrapped_run
    for m in list(sys.modules.values()):  # the kernel modules imported launch by name
        if m is not None and getattr(m, "launch", None) is direct:
            setattr(m, "launch", wrapped_launch)
    torch._grouped_mm = wrap("torch._grouped_mm", torch._grouped_mm)


def install(timers: Timers) -> None:
    def wrap(name, fn):
        if name.startswith("launch "):  # every launch counts (a launch inside a launch does not happen)
            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timers.add(name, time.perf_counter() - t0)
            return timed
        return timers.wrap(name, fn)
    install_wrappers(wrap)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b")
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--tokens", type=int, default=None, help="tokens per call instead of the shape's own T")
    p.add_argument("--launches", default="direct", help="comma list: direct (kernels.launch, the default), triton "
                   "(every launch through kernel[grid](...)); each timed in turn per shape")
    p.add_argument("--queued", action="store_true",
                   help="each call behind ~20 ms of queued GEMMs (bench moe's host-ahead lead-in): the host's costs "
                        "with the GPU busy, instead of each call from an idle GPU")
    a = p.parse_args()
    timers = Timers()
    install(timers)
    modes = a.launches.split(",")
    if any(m not in ("direct", "triton") for m in modes):
        raise SystemExit(f"--launches {a.launches!r}: a comma list of direct and triton")
    for shape in layer_ab.gpu_shapes(a.shapes, "scripts/host_breakdown.py"):
        s = bench.shape_at(shape, a.tokens)
        args = bench.layer_inputs(s, "balanced", torch.Generator(device="cuda").manual_seed(0))
        fn = bench.HostAhead(bench.ours(a.backend)) if a.queued else bench.ours(a.backend)
        for mode in modes:
            kernel_launch.use_direct(mode == "direct")
            _report(shape, s.T, mode, fn, args, timers, a)
        kernel_launch.use_direct(True)
        del args
        torch.cuda.empty_cache()


def _report(shape: str, tokens: int, mode: str, fn, args, timers: Timers, a) -> None:
    phases = {"forward": [], "backward": [], "GPU": []}
    for i in range(3 + a.calls):
        if i == 3:  # autotuning, auto's measurement and the allocator settle in the first calls
            timers.reset()
        torch.cuda.synchronize()
        fwd, bwd, start, end = _call(fn, args, phase=lambda name: setattr(timers, "phase", name))
        end.synchronize()
        if i >= 3:
            phases["forward"].append(fwd * 1e3)
            phases["backward"].append(bwd * 1e3)
            phases["GPU"].append(start.elapsed_time(end))
    med = {k: statistics.median(v) for k, v in phases.items()}
    print(f"== {shape} at {tokens} tokens, ours ({a.backend}), {mode} launches: host forward {med['forward']:.3f} ms, "
          f"backward {med['backward']:.3f} ms; GPU start->end {med['GPU']:.3f} ms (medians of {a.calls} calls"
          f"{', queued' if a.queued else ''})", flush=True)
    print(f"{'piece (inclusive)':58s} {'calls/call':>10s} {'us/call':>9s} {'us each':>8s}")
    for name in sorted(timers.total, key=lambda n: (not n.startswith("forward"), -timers.total[n])):
        per_call = timers.total[name] / a.calls * 1e6
        n = timers.calls[name] / a.calls
        print(f"{name:58s} {n:10.1f} {per_call:9.1f} {per_call / n:8.1f}")
    timers.reset()


if __name__ == "__main__":
    main()
