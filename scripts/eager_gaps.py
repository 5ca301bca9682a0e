"""Where an eager layer call's GPU waits on the host, without a profiler: a CUDA event and a host clock reading at
the entry of chosen functions and before every Triton / Gluon launch and torch._grouped_mm (host_breakdown.py's
list), in a call from an idle GPU (as `bench moe` times "ours") and in the same call behind queued GPU work
("host-ahead"). Matched marker by marker, each segment's GPU time eager minus host-ahead is what the GPU idled there
waiting for the host.

    python scripts/eager_gaps.py [--shapes qwen3-30b-a3b,gpt-oss-20b] [--calls 7] [--tokens N] [--routing skewed]

Printed per marker (medians over the calls): the host's time since the call began, the GPU's (the event's
timestamp), the segment to the next marker on the GPU eager and host-ahead, and their difference (the idle).
Recording an event costs the host a few microseconds, so the eager call runs a little slower than unmarked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from host_breakdown import install_wrappers  # (this folder)

from moetrain.bench import layer_ab
from moetrain.bench import moe_layer as bench


class Marks:
    def __init__(self):
        self.on = False
        self.marks: list = []  # (label, host seconds, event)

    def mark(self, label: str) -> None:
        if self.on:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((label, time.perf_counter(), ev))

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
    t0 = time.perf_counter()
    marks.marks, marks.on = [], True
    out = fn(x, router_w, forcing, w1, w2, K)
    marks.mark("backward()")
    out.backward(grad_out)
    marks.mark("end")
    marks.on = False
    torch.cuda.synchronize()
    return [(label, (h - t0) * 1e3, start.elapsed_time(ev)) for label, h, ev in marks.marks]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-20b")
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=7)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--routing", default="balanced", choices=("balanced", "skewed"))
    p.add_argument("--min-idle", type=float, default=0.02, help="ms: segments idling less are summed, not listed")
    a = p.parse_args()
    if a.calls < 1 or (a.tokens is not None and a.tokens < 1):
        raise SystemExit(f"--calls {a.calls}, --tokens {a.tokens}: each at least 1")
    marks = Marks()
    install_wrappers(marks.wrap)
    for shape in layer_ab.gpu_shapes(a.shapes, "scripts/eager_gaps.py"):
        s = bench.shape_at(shape, a.tokens)
        args = bench.layer_inputs(s, a.routing, torch.Generator(device="cuda").manual_seed(0))
        fn = bench.ours(a.backend)
        lead = bench.HostAhead(fn)
        for _ in range(3):  # autotuning, auto's measurement and the allocator settle in the first calls
            one_call(fn, args, marks)
        runs = {"eager": [], "ahead": []}
        for _ in range(a.calls):
            runs["eager"].append(one_call(fn, args, marks))
            runs["ahead"].append(one_call(fn, args, marks, lead.lead_in))
        labels = [m[0] for m in runs["eager"][0]]
        if any([m[0] for m in r] != labels for rs in runs.values() for r in rs):
            print(f"== {shape}: the calls issued different marker sequences; skipped")
            continue

        def med(mode: str, i: int, j: int) -> float:
            return statistics.median(r[i][j] for r in runs[mode])

        def seg(mode: str, i: int) -> float:  # GPU time from marker i to i + 1
            return statistics.median(r[i + 1][2] - r[i][2] for r in runs[mode])

        total_e, total_a = med("eager", len(labels) - 1, 2), med("ahead", len(labels) - 1, 2)
        print(f"== {shape} {a.routing} at {s.T} tokens, ours ({a.backend}): GPU start->end eager {total_e:.3f} ms, "
              f"host-ahead {total_a:.3f} ms (medians of {a.calls} calls, {len(labels)} markers)", flush=True)
        print(f"{'#':>3s} {'marker (next segment: up to the next marker)':46s} {'host ms':>8s} {'GPU ms':>8s} "
              f"{'seg eager':>9s} {'seg ahead':>9s} {'idle':>7s}")
        small = 0.0
        for i, label in enumerate(labels[:-1]):
            idle = seg("eager", i) - seg("ahead", i)
            if abs(idle) < a.min_idle:
                small += idle
                continue
            print(f"{i:3d} {label[:46]:46s} {med('eager', i, 1):8.3f} {med('eager', i, 2):8.3f} {seg('eager', i):9.3f} "
                  f"{seg('ahead', i):9.3f} {idle:7.3f}")
        start_idle = med("eager", 0, 2) - med("ahead", 0, 2)
        print(f"    before the first marker: {start_idle:.3f} ms idle; segments under {a.min_idle} ms: {small:.3f} "
              f"ms in all", flush=True)
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
