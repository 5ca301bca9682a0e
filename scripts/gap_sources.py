"""Why the GPU idles in an eager MoE layer call: every GPU operation of one profiled forward + backward with the
host time of its launch and the moetrain function that launched it (moetrain.bench.launch_trace).

    python scripts/gap_sources.py [--shapes qwen3-30b-a3b,deepseek-v3] [--backend auto] [--first 30]

Session 7's profile put 1.4 ms (Qwen3) and 2.45 ms (DeepSeek-V3) of GPU idle time in each eager call of ours, in
20-25 gaps before small kernels, with no allocator call or sync inside (session 8: `bench moe`'s mallocs column
0): the host issuing too slowly. This lists where the host's time goes before each of those kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from moetrain.bench import moe_layer as bench
from moetrain.bench.launch_trace import call_launches, describe_launches


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--backend", default="auto")
    p.add_argument("--first", type=int, default=30, help="launches listed from the call's start")
    a = p.parse_args()
    from torch.profiler import ProfilerActivity, profile, record_function

    for name in a.shapes.split(","):
        s = bench.SHAPES[name]
        args = bench.layer_inputs(s, "balanced", torch.Generator(device="cuda").manual_seed(0))
        fn = bench.ours(a.backend)
        for _ in range(3):  # autotuning, auto's measurement, allocator
            bench._fwd_bwd(fn, args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            with record_function("call 0"):
                bench._fwd_bwd(fn, args)
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            trace = json.load(open(path))
        print(f"== {name}, ours ({a.backend}), one eager forward + backward", flush=True)
        print(describe_launches(call_launches(trace), first=a.first), flush=True)
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
