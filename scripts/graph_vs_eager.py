"""Our layer eager against the same forward + backward replayed from a CUDA graph, kernel by kernel: which kernels'
GPU time differs between the two (bench moe's "graph" column ran 0.2-0.8 ms under host-ahead at DeepSeek-V3 in
sessions 20-21; session 22 found no kernel faster graphed), beside the wall times of the three ways of running it,
timed in turns.

    python scripts/graph_vs_eager.py [--shapes deepseek-v3] [--routing skewed] [--calls 3] [--reps 5]

Prints, per shape: eager / host-ahead / graphed medians (ms, `bench moe`'s contenders and timing); then each kernel's
GPU time per call eager and graphed (torch.profiler, the mean of --calls profiled calls each), largest differences
first; then the timeline of one profiled call of each (busy, idle, the largest gaps).
"""

from __future__ import annotations

import argparse

import torch

from moetrain.bench import layer_ab
from moetrain.bench import moe_layer as bench
from moetrain.bench.gpu_timeline import describe, kernel_totals, profile_calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="deepseek-v3")
    p.add_argument("--routing", default="skewed", choices=("balanced", "skewed"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=16)
    a = p.parse_args()
    if a.calls < 1 or a.reps < 1:
        raise SystemExit(f"--calls {a.calls}, --reps {a.reps}: each at least 1")
    for shape in layer_ab.gpu_shapes(a.shapes, "scripts/graph_vs_eager.py"):
        s = bench.shape_at(shape)
        args = bench.layer_inputs(s, a.routing, torch.Generator(device="cuda").manual_seed(0))
        fn = bench.ours(a.backend)
        contenders = {"eager": fn, "host-ahead": bench.HostAhead(fn), "graph": bench.Graphed(fn)}
        timed = bench.time_contenders(contenders, lambda: args, warmup=1, reps=a.reps)
        print(f"== {shape} {a.routing}, ours ({a.backend}): "
              + ", ".join(f"{name} {timed[name][0]:.2f} ms" for name in contenders), flush=True)
        graph = contenders["graph"]
        runs = {"eager": profile_calls(lambda: bench._fwd_bwd(fn, args), calls=a.calls),
                "graph": profile_calls(lambda: graph.replay(args), calls=a.calls)}
        totals = {mode: kernel_totals(t) for mode, t in runs.items()}
        names = set(totals["eager"]) | set(totals["graph"])

        def ms(mode: str, name: str) -> float:
            return totals[mode].get(name, (0.0, 0.0))[1] / 1e3

        rows = sorted(names, key=lambda n: -abs(ms("eager", n) - ms("graph", n)))
        print(f"  kernels per call: eager {sum(ms('eager', n) for n in names):.3f} ms, graph "
              f"{sum(ms('graph', n) for n in names):.3f} ms; largest differences:")
        print(f"  {'eager ms':>9s} {'graph ms':>9s} {'diff':>7s} {'launches':>8s}  kernel")
        for name in rows[:a.top]:
            launches = totals["eager"].get(name, totals["graph"].get(name))[0]
            print(f"  {ms('eager', name):9.3f} {ms('graph', name):9.3f} {ms('eager', name) - ms('graph', name):7.3f} "
                  f"{launches:8.1f}  {name[:90]}", flush=True)
        for mode, t in runs.items():
            print(f"  {mode} timeline: {describe(t[-1])}", flush=True)
        graph.release()
        args = contenders = runs = None  # (the next shape's inputs need the memory)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
