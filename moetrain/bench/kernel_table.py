"""What the MoE layer is made of: our layer's kernels per call, eager against the same forward + backward replayed
from a CUDA graph, beside the wall times of the three ways `bench moe` runs it (eager, host-ahead, graphed), timed in
turns.

    moetrain bench kernels [--shapes qwen3-30b-a3b] [--routing balanced] [--calls 3] [--reps 5] [--top 40]

Prints, per shape: eager / host-ahead / graphed medians (ms, `bench moe`'s contenders and timing); then each kernel's
GPU time per call eager and graphed (torch.profiler, the mean of --calls profiled calls each), largest differences
first (--top of them); then the timeline of one profiled call of each (busy, idle, the largest gaps).
bench/moe_layer.md has the latest breakdown.
"""

from __future__ import annotations

import argparse

import torch

from moetrain.bench import moe_layer as bench
from moetrain.bench.common import (
    at_least,
    parse_routings,
    parse_shapes,
    require_gpu,
    shape_at,
)
from moetrain.bench.gpu_timeline import describe, kernel_totals, profile_calls
from moetrain.errors import UserError


def kernel_rows(totals: dict[str, dict[str, tuple[float, float]]]) -> list[tuple[str, float, float, float]]:
    """(kernel, eager ms, graph ms, launches per call) per kernel, from kernel_totals of each mode (name -> (count,
    us)), the largest eager-graph difference first; a kernel missing in one mode counts 0 ms there."""
    names = set(totals["eager"]) | set(totals["graph"])

    def ms(mode: str, name: str) -> float:
        return totals[mode].get(name, (0.0, 0.0))[1] / 1e3

    rows = [(n, ms("eager", n), ms("graph", n), totals["eager"].get(n, totals["graph"].get(n))[0]) for n in names]
    return sorted(rows, key=lambda r: -abs(r[1] - r[2]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moetrain bench kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--routing", default="balanced", help="one bench moe routing: balanced, skewed, skewed:A")
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=16)
    a = p.parse_args(argv)
    names = parse_shapes(a.shapes)
    routings = parse_routings(a.routing)
    if len(routings) != 1:
        raise UserError(f"--routing {a.routing!r}: one routing per run")
    for option, value, what in (("--calls", a.calls, "call"), ("--reps", a.reps, "repetition"),
                                ("--top", a.top, "kernel")):
        at_least(option, value, 1, what)
    require_gpu("kernels")
    for name in names:
        _report(name, routings[0], a)
        torch.cuda.empty_cache()
    return 0


def _report(name: str, routing: str, a) -> None:
    s = shape_at(name)
    args = bench.layer_inputs(s, routing, torch.Generator(device="cuda").manual_seed(0))
    fn = bench.ours(a.backend)
    contenders = {"eager": fn, "host-ahead": bench.HostAhead(fn), "graph": bench.Graphed(fn)}
    timed = bench.time_contenders(contenders, lambda: args, warmup=1, reps=a.reps)
    print(f"== {name} {routing}, ours ({a.backend}): "
          + ", ".join(f"{mode} {timed[mode][0]:.2f} ms" for mode in contenders), flush=True)
    graph = contenders["graph"]
    runs = {"eager": profile_calls(lambda: bench._fwd_bwd(fn, args), calls=a.calls),
            "graph": profile_calls(lambda: graph.replay(args), calls=a.calls)}
    rows = kernel_rows({mode: kernel_totals(t) for mode, t in runs.items()})
    print(f"  kernels per call: eager {sum(r[1] for r in rows):.3f} ms, graph {sum(r[2] for r in rows):.3f} ms; "
          "largest differences:")
    print(f"  {'eager ms':>9s} {'graph ms':>9s} {'diff':>7s} {'launches':>8s}  kernel")
    for kernel, eager_ms, graph_ms, launches in rows[:a.top]:
        print(f"  {eager_ms:9.3f} {graph_ms:9.3f} {eager_ms - graph_ms:7.3f} {launches:8.1f}  {kernel[:90]}", flush=True)
    for mode, t in runs.items():
        print(f"  {mode} timeline: {describe(t[-1])}", flush=True)
    graph.release()


if __name__ == "__main__":
    raise SystemExit(main())
