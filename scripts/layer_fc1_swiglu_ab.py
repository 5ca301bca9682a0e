"""The whole MoE layer (forward + backward, `bench moe`'s "ours (auto)") with FC1 + SwiGLU forced to the separate
kernels or to the fused ping-pong kernel (moe_fused.fc1_swiglu), in turns, in one process. auto makes this choice
once, from a few timings of the forward inside the layer's first call; this times the whole layer both ways.

    python scripts/layer_fc1_swiglu_ab.py --shapes qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b --reps 7

Contenders: the eager reference, ours with each variant, the same behind queued GPU work (host ahead), and the six
torch GEMMs ("/ GEMMs": the issue's floor). Every other choice of auto stays as it made it.
"""

from __future__ import annotations

import argparse

import torch

VARIANTS = ("separate", "fused")


def forced(layer, key: str, variant: str):
    """The layer with auto's cache entry ``key`` set to ``variant`` for its call (and the backward that follows it:
    the contenders run one at a time)."""
    from moetrain.ops import autoselect

    def run(*args):
        autoselect._entries()[key] = {"backend": variant, "ms": {}}
        return layer(*args)
    return run


def main(argv=None) -> int:
    from moetrain.bench import layer_ab
    from moetrain.bench import moe_layer as ml
    from moetrain.ops import autoselect

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    layer_ab.add_layer_args(ap, shapes="qwen3-30b-a3b", reps=7)
    args = ap.parse_args(argv)
    for name in layer_ab.gpu_shapes(args.shapes, "scripts/layer_fc1_swiglu_ab.py"):
        s = ml.SHAPES[name]
        make_args = layer_ab.inputs_of(s, args.routing)

        auto = ml.ours("auto")
        print(f"{name} {args.routing}: first call (autotuning, auto's measurements)", flush=True)
        ml._fwd_bwd(auto, make_args())
        torch.cuda.synchronize()
        # (the cache file may hold other shapes' choices: the key names FC1's N = 2I and K = H)
        keys = [k for k in autoselect.entries() if k.startswith("moe_fc1_swiglu|") and f"|N{2 * s.I}|K{s.H}|" in k]
        if len(keys) != 1:
            raise SystemExit(f"{name}: expected one moe_fc1_swiglu choice (a Hopper GPU), found {keys}")
        entry = autoselect.entries()[keys[0]]
        print(f"  auto chose {entry['backend']} ({autoselect.describe_times(entry['ms'])} ms)", flush=True)
        ours = {f"ours, FC1 + SwiGLU {variant}": forced(auto, keys[0], variant) for variant in VARIANTS}
        timed = layer_ab.time_forced(s, args.routing, ours, make_args, args.warmup, args.reps)
        layer_ab.print_forced(timed, f"{name} {args.routing}", args.reps, 48)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
