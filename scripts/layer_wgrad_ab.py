"""The whole MoE layer (forward + backward, `bench moe`'s "ours (auto)") with its weight gradients forced to one
config or another, in turns, in one process: does the ping-pong weight gradient make the layer faster where the
autotuner rejected it? (Session 11: in isolation the ping-pong ran 7.1-7.3 ms against our Triton kernel's 8.8 at
DeepSeek-V3's FC1, yet the autotuner, timing inside the layer's first call, kept the Triton kernel in two processes.)

    python scripts/layer_wgrad_ab.py --shapes deepseek-v3,qwen3-30b-a3b --reps 9

Contenders: the eager reference, ours with the autotuner's choices, ours with every weight gradient on each
ping-pong config, the same behind queued GPU work (host ahead), and the six torch GEMMs. Each row prints the wall
time (time.time()) at its start, so that a GPU clock log (nvidia-smi) can be laid beside it.
"""

from __future__ import annotations

import argparse
import time

import torch


def forced(layer, configs: dict):
    """The layer with the autotuner's cache entries set to configs (key -> GemmConfig) for its call (forward and the
    backward that follows it: the contenders run one at a time)."""
    from moetrain.kernels import grouped_gemm_tuning as tuning

    def run(*args):
        tuning._BEST.update(configs)
        return layer(*args)
    return run


def main(argv=None) -> int:
    from moetrain.bench import layer_ab
    from moetrain.bench import moe_layer as ml
    from moetrain.kernels import grouped_gemm_tuning as tuning

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    layer_ab.add_layer_args(ap, shapes="deepseek-v3", reps=9)
    ap.add_argument("--configs", default=None, help="weight-gradient configs to force, comma-separated, as printed "
                    "(any of configs_for('wgrad'), trial ones included); default: the first two ping-pong configs and "
                    "the first Triton one")
    args = ap.parse_args(argv)
    known = {str(c): c for c in tuning.configs_for("wgrad")}
    if args.configs:
        bad = [c for c in args.configs.split(",") if c not in known]
        if bad:
            raise SystemExit(f"--configs: unknown {bad}; known: {', '.join(known)}")
        forced_configs = [known[c] for c in args.configs.split(",")]
    else:
        forced_configs = list(tuning.PINGPONG_WGRAD_CONFIGS[:2] + tuning.WGRAD_CONFIGS[:1])
    for name in layer_ab.gpu_shapes(args.shapes, "scripts/layer_wgrad_ab.py"):
        s = ml.SHAPES[name]
        make_args = layer_ab.inputs_of(s, args.routing)

        auto = ml.ours("auto")
        print(f"{time.time():.1f} {name} {args.routing}: first call (autotuning)", flush=True)
        ml._fwd_bwd(auto, make_args())
        torch.cuda.synchronize()
        tuned = tuning.tuned_configs()
        keys = [k for k in tuned if k[0] == "wgrad"]
        if not keys:  # auto chose torch for both weight gradients: nothing of ours to force
            print(f"  {name}: no weight gradient of ours in the layer (auto chose torch); skipped", flush=True)
            continue
        chosen = {str(k[3:6]): str(tuned[k]) for k in keys}
        print(f"  autotuner's weight-gradient choices: {chosen}", flush=True)
        ours = {"ours (auto's choices)": forced(auto, {k: tuned[k] for k in keys})}
        for cfg in forced_configs:
            ours[f"ours, wgrad {cfg}"] = forced(auto, dict.fromkeys(keys, cfg))
        timed = layer_ab.time_forced(s, args.routing, ours, make_args, args.warmup, args.reps, stamp=True)
        tuning._BEST.update(tuned)  # the autotuner's choices back in place
        layer_ab.print_forced(timed, f"{time.time():.1f} {name} {args.routing}", args.reps, 62)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
