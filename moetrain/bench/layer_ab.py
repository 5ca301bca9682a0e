"""The whole MoE layer (bench moe's "ours (auto)") with some of auto's or the autotuner's choices forced, timed in
turns against the eager reference and the six torch GEMMs: the shared part of the A/B scripts
(scripts/layer_wgrad_ab.py, scripts/layer_fc1_swiglu_ab.py).

    add_layer_args(ap, ...)     the scripts' common options: --shapes, --routing, --reps, --warmup
    gpu_shapes(text, script)    the --shapes names (moe_layer.SHAPES), with a CUDA GPU; else one line and exit
    inputs_of(s, routing)       make_args for one shape: fresh layer inputs from one generator
    time_forced(...)            the contenders, each also behind queued GPU work (host ahead), timed in turns
    print_forced(...)           their table: ms, spread, x the eager reference, / the six torch GEMMs
"""

from __future__ import annotations

import time

import torch

from moetrain.bench import moe_layer as ml


def add_layer_args(ap, shapes: str, reps: int) -> None:
    """--shapes (comma-separated moe_layer.SHAPES names), --routing, --reps and --warmup, with a script's defaults."""
    ap.add_argument("--shapes", default=shapes)
    ap.add_argument("--routing", default="balanced", choices=("balanced", "skewed"))
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--warmup", type=int, default=2)


def inputs_of(s: ml.Shape, routing: str):
    """make_args for shape s: each call fresh layer inputs (moe_layer.layer_inputs) from one CUDA generator seeded 0."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    return lambda: ml.layer_inputs(s, routing, gen)


def gpu_shapes(text: str, script: str) -> list:
    names = text.split(",")
    unknown = [n for n in names if n not in ml.SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {', '.join(ml.SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} times the layer on a GPU: no CUDA device visible")
    return names


def time_forced(s: ml.Shape, routing: str, ours: dict, make_args, warmup: int, reps: int,
                stamp: bool = False) -> dict:
    """label -> (ms, peak, spread, events, reps ms) (moe_layer.time_contenders) of the eager reference, each of ``ours``
    (label -> layer, labels starting "ours"), the same host ahead, and the six torch GEMMs; every contender runs once
    before anything is timed (each forced variant compiled and tuned). ``stamp``: a wall-clock line before timing, to
    lay beside a GPU clock log."""
    contenders = {"reference eager": ml.reference_layer, **ours}
    for label in ours:
        contenders[f"{label}, host ahead"] = ml.HostAhead(ours[label])
    contenders[ml.FLOOR] = ml.GemmFloor(s, routing)
    for fn in contenders.values():
        ml._fwd_bwd(fn, make_args())
    if stamp:
        print(f"{time.time():.1f} timing {len(contenders)} contenders in turns", flush=True)
    return ml.time_contenders(contenders, make_args, warmup, reps)


def print_forced(timed: dict, head: str, reps: int, width: int) -> None:
    ref, floor = timed["reference eager"][0], timed[ml.FLOOR][0]
    print(f"{head} (ms, median of {reps}; x eager; / six torch GEMMs)")
    for label, (ms, _peak, spread, *_) in timed.items():
        print(f"  {label:{width}s} {ms:8.2f} ±{spread:4.1f}%  {ref / ms:5.2f}x  {ms / floor:5.2f}", flush=True)
