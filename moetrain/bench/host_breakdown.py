"""Host time of each piece of our eager MoE layer call (forward, then backward), without a profiler: the functions of
bench.host_hooks.WRAPPED are wrapped with a wall-clock timer (inclusive of what they call; ~1 us per wrapped call),
every Triton / Gluon launch is timed per kernel, and torch._grouped_mm per call.

    moetrain bench host [--shapes gpt-oss-20b,qwen3-30b-a3b] [--backend auto] [--calls 20] [--tokens N]
                        [--queued] [--launches direct,triton]

Why: in an eager call the GPU waits whenever the host issues slower than the GPU runs (bench/host_overhead.md).
cProfile's per-call overhead distorts small functions; this times only the listed ones. Prints per shape the host's
forward and backward issue times and the GPU's start-to-end time (medians over --calls calls after three settling
ones), then each piece: calls per layer call, us per layer call, us each.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from moetrain.bench import moe_layer as bench
from moetrain.bench.common import at_least, parse_shapes, require_gpu, shape_at
from moetrain.bench.host_hooks import one_call, wrap_functions, wrap_launches
from moetrain.errors import UserError
from moetrain.kernels import launch as kernel_launch

SETTLE = 3  # calls before timing: autotuning, auto's measurement and the allocator settle in the first ones


class Timers:
    """Inclusive seconds and call counts per "phase: name"; a function called inside itself counts once."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.total = collections.defaultdict(float)  # name -> seconds
        self.calls = collections.Counter()
        self.active = collections.Counter()  # recursion: only the outermost call counts
        self.phase = ""  # "forward" or "backward": part of every name

    def wrap(self, name: str, fn):
        if name.startswith("launch "):  # every launch counts (a launch inside a launch does not happen)
            def timed_launch(*args, **kwargs):
                t0 = self.clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.add(name, self.clock() - t0)
            return timed_launch

        def timed(*args, **kwargs):
            if self.active[name]:
                return fn(*args, **kwargs)
            self.active[name] += 1
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, self.clock() - t0)
                self.active[name] -= 1
        return timed

    def add(self, name: str, seconds: float) -> None:
        key = f"{self.phase}: {name}"
        self.total[key] += seconds
        self.calls[key] += 1

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def table(self, calls: int) -> list[str]:
        """The pieces per layer call, forward first, each phase by time: name, calls, us per layer call, us each."""
        lines = [f"{'piece (inclusive)':58s} {'calls/call':>10s} {'us/call':>9s} {'us each':>8s}"]
        for name in sorted(self.total, key=lambda n: (not n.startswith("forward"), -self.total[n])):
            per_call = self.total[name] / calls * 1e6
            n = self.calls[name] / calls
            lines.append(f"{name:58s} {n:10.1f} {per_call:9.1f} {per_call / n:8.1f}")
        return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moetrain bench host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b")
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--tokens", type=int, default=None, help="tokens per call instead of the shape's own T")
    p.add_argument("--launches", default="direct", help="comma list: direct (kernels.launch, the default), triton "
                   "(every launch through kernel[grid](...)); each timed in turn per shape")
    p.add_argument("--queued", action="store_true",
                   help="each call behind ~20 ms of queued GEMMs (bench moe's host-ahead lead-in): the host's costs "
                        "with the GPU busy, instead of each call from an idle GPU")
    a = p.parse_args(argv)
    names = parse_shapes(a.shapes)
    at_least("--calls", a.calls, 1, "call")
    at_least("--tokens", a.tokens, 1, "token per layer call")
    modes = a.launches.split(",")
    if any(m not in ("direct", "triton") for m in modes):
        raise UserError(f"--launches {a.launches!r}: a comma list of direct and triton")
    require_gpu("host")

    timers = Timers()
    missing = wrap_functions(timers.wrap)
    wrap_launches(timers.wrap)
    if missing:
        print(f"not found, not timed: {', '.join(missing)}", flush=True)
    for name in names:
        s = shape_at(name, a.tokens)
        args = bench.layer_inputs(s, "balanced", torch.Generator(device="cuda").manual_seed(0))
        fn = bench.ours(a.backend)
        lead_in = bench.HostAhead(fn).lead_in if a.queued else None
        for mode in modes:
            kernel_launch.use_direct(mode == "direct")
            _report(name, s.T, mode, fn, args, timers, a, lead_in)
        kernel_launch.use_direct(True)
        del args
        torch.cuda.empty_cache()
    return 0


def _report(shape: str, tokens: int, mode: str, fn, args, timers: Timers, a, lead_in) -> None:
    phases = {"forward": [], "backward": [], "GPU": []}
    for i in range(SETTLE + a.calls):
        if i == SETTLE:
            timers.reset()
        torch.cuda.synchronize()
        fwd, bwd, start, end = one_call(fn, args, phase=lambda name: setattr(timers, "phase", name), lead_in=lead_in)
        end.synchronize()
        if i >= SETTLE:
            phases["forward"].append(fwd * 1e3)
            phases["backward"].append(bwd * 1e3)
            phases["GPU"].append(start.elapsed_time(end))
    med = {k: statistics.median(v) for k, v in phases.items()}
    print(f"== {shape} at {tokens} tokens, ours ({a.backend}), {mode} launches: host forward {med['forward']:.3f} ms, "
          f"backward {med['backward']:.3f} ms; GPU start->end {med['GPU']:.3f} ms (medians of {a.calls} calls"
          f"{', queued' if a.queued else ''})", flush=True)
    print("\n".join(timers.table(a.calls)), flush=True)
    timers.reset()


if __name__ == "__main__":
    raise SystemExit(main())
