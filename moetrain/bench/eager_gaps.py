"""Where an eager layer call's GPU waits on the host, without a profiler: a CUDA event and a host clock reading at
the entry of bench.host_hooks.WRAPPED's functions and before every Triton / Gluon launch and torch._grouped_mm, in a
call from an idle GPU (as `bench moe` times "ours") and in the same call behind queued GPU work ("host-ahead").
Matched marker by marker, each segment's GPU time eager minus host-ahead is what the GPU idled there waiting for the
host.

    moetrain bench gaps [--shapes qwen3-30b-a3b,gpt-oss-20b] [--calls 7] [--tokens N] [--routing skewed]

Printed per marker (medians over the calls): the host's time since the call began, the GPU's (the event's
timestamp), the segment to the next marker on the GPU eager and host-ahead, and their difference (the idle).
Recording an event costs the host a few microseconds, so the eager call runs a little slower than unmarked.
bench/host_overhead.md has the latest results.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moetrain.bench import moe_layer as bench
from moetrain.bench.common import (
    at_least,
    parse_routings,
    parse_shapes,
    require_gpu,
    shape_at,
)
from moetrain.bench.host_hooks import wrap_functions, wrap_launches
from moetrain.errors import UserError

SETTLE = 3  # calls before the marked ones: autotuning, auto's measurement and the allocator settle


class Marks:
    """(label, host seconds, CUDA event) at each marked point while ``on``."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.on = False
        self.marks: list = []

    def mark(self, label: str) -> None:
        if self.on:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((label, self.clock(), ev))

    def wrap(self, name: str, fn):
        def marked(*args, **kwargs):
            self.mark(name)
            return fn(*args, **kwargs)
        return marked


def one_call(fn, args, marks: Marks, lead_in=None) -> list:
    """[(label, host ms, GPU ms)] since the call's start, the last entry the call's end."""
    x, router_w, forcing, w1, w2, K, grad_out = args
    for t in (x, w1, w2):
        t.grad = None
    torch.cuda.synchronize()
    if lead_in is not None:
        lead_in()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = marks.clock()
    marks.marks, marks.on = [], True
    out = fn(x, router_w, forcing, w1, w2, K)
    marks.mark("backward()")
    out.backward(grad_out)
    marks.mark("end")
    marks.on = False
    torch.cuda.synchronize()
    return [(label, (h - t0) * 1e3, start.elapsed_time(ev)) for label, h, ev in marks.marks]


def idle_segments(eager: list[list], ahead: list[list]) -> list[tuple[int, str, float, float, float, float, float]]:
    """Per marker i of matched calls (each a one_call list): (i, label, host ms, GPU ms, eager segment, host-ahead
    segment, idle = their difference), medians over the calls; a segment runs from marker i to i + 1."""
    def med(runs, i, j):
        return statistics.median(r[i][j] for r in runs)

    def seg(runs, i):
        return statistics.median(r[i + 1][2] - r[i][2] for r in runs)

    labels = [m[0] for m in eager[0]]
    return [(i, label, med(eager, i, 1), med(eager, i, 2), seg(eager, i), seg(ahead, i), seg(eager, i) - seg(ahead, i))
            for i, label in enumerate(labels[:-1])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moetrain bench gaps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b")
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=7)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--routing", default="balanced", help="one bench moe routing: balanced, skewed, skewed:A")
    p.add_argument("--min-idle", type=float, default=0.02, help="ms: segments idling less are summed, not listed")
    a = p.parse_args(argv)
    names = parse_shapes(a.shapes)
    routings = parse_routings(a.routing)
    if len(routings) != 1:
        raise UserError(f"--routing {a.routing!r}: one routing per run")
    at_least("--calls", a.calls, 1, "call")
    at_least("--tokens", a.tokens, 1, "token per layer call")
    require_gpu("gaps")
    marks = Marks()
    wrap_functions(marks.wrap)
    wrap_launches(marks.wrap)
    for name in names:
        _report(name, shape_at(name, a.tokens), routings[0], a, marks)
        torch.cuda.empty_cache()
    return 0


def _report(name: str, s, routing: str, a, marks: Marks) -> None:
    args = bench.layer_inputs(s, routing, torch.Generator(device="cuda").manual_seed(0))
    fn = bench.ours(a.backend)
    lead = bench.HostAhead(fn)
    for _ in range(SETTLE):
        one_call(fn, args, marks)
    runs = {"eager": [], "ahead": []}
    for _ in range(a.calls):
        runs["eager"].append(one_call(fn, args, marks))
        runs["ahead"].append(one_call(fn, args, marks, lead.lead_in))
    labels = [m[0] for m in runs["eager"][0]]
    if any([m[0] for m in r] != labels for rs in runs.values() for r in rs):
        print(f"== {name}: the calls issued different marker sequences; skipped")
        return
    total_e = statistics.median(r[-1][2] for r in runs["eager"])
    total_a = statistics.median(r[-1][2] for r in runs["ahead"])
    print(f"== {name} {routing} at {s.T} tokens, ours ({a.backend}): GPU start->end eager {total_e:.3f} ms, "
          f"host-ahead {total_a:.3f} ms (medians of {a.calls} calls, {len(labels)} markers)", flush=True)
    print(f"{'#':>3s} {'marker (next segment: up to the next marker)':46s} {'host ms':>8s} {'GPU ms':>8s} "
          f"{'seg eager':>9s} {'seg ahead':>9s} {'idle':>7s}")
    small = 0.0
    for i, label, host, gpu, seg_e, seg_a, idle in idle_segments(runs["eager"], runs["ahead"]):
        if abs(idle) < a.min_idle:
            small += idle
            continue
        print(f"{i:3d} {label[:46]:46s} {host:8.3f} {gpu:8.3f} {seg_e:9.3f} {seg_a:9.3f} {idle:7.3f}")
    start_idle = (statistics.median(r[0][2] for r in runs["eager"])
                  - statistics.median(r[0][2] for r in runs["ahead"]))
    print(f"    before the first marker: {start_idle:.3f} ms idle; segments under {a.min_idle} ms: {small:.3f} "
          f"ms in all", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
