"""What one Triton / Gluon launch costs the host, piece by piece, for every launch of our eager MoE layer call (GPU):
the launches of one forward + backward are recorded (JITFunction.run's arguments), then each is re-issued in loops
and timed: the whole ``kernel[grid](...)`` call, and the pieces of Triton's JITFunction.run (the argument binder, the
cache key, the launch metadata, the compiled kernel's C launcher alone). Also the PyTorch calls our launchers wrap
around it (torch.cuda.device's context, torch.empty, a TMA TensorDescriptor).

    python scripts/launch_cost.py [--shapes qwen3-30b-a3b] [--tokens 4096] [--loops 20]

Why: host_breakdown.py (session 16, call A) measured 40-120 us per launch on the H200's host and ~20 launches per
layer call; whether a launcher that keeps the compiled kernel and calls its C launcher directly would pay depends
on how much of that is the binder and the key (skippable) and how much the C launcher (not).
Each loop issues one launch 25 times and syncs outside the timed part (the launch queue never fills). Written for
Triton 3.6's JITFunction.run; another version may need the piece names adjusted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from host_profile_moe import _call  # (this folder)

from moetrain.bench import layer_ab
from moetrain.bench import moe_layer as bench

BATCH = 25


def per_call_us(fn, loops: int) -> float:
    """Median microseconds per fn() over ``loops`` batches of BATCH calls (sync between batches, not timed)."""
    per = []
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(BATCH):
            fn()
        per.append((time.perf_counter() - t0) / BATCH * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per)


def _record(fn, args) -> list:
    """Every JITFunction.run of one layer call: (jit function, args, kwargs). The call launches through Triton
    (kernels.launch's direct launches off), so that every launch passes JITFunction.run."""
    from triton.runtime.jit import JITFunction

    from moetrain.kernels import launch as kernel_launch

    seen, run = [], JITFunction.run

    def recording(self, *a, **kw):
        seen.append((self, a, dict(kw)))
        return run(self, *a, **kw)
    JITFunction.run = recording
    kernel_launch.use_direct(False)
    try:
        _call(fn, args)
        torch.cuda.synchronize()
    finally:
        JITFunction.run = run
        kernel_launch.use_direct(True)
    return seen


def _pieces(jit, a, kw, loops: int) -> dict:
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    kw = dict(kw)
    grid = kw.pop("grid")
    kw.pop("warmup", None)
    full = dict(kw)
    kw["debug"] = kw.get("debug", jit.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    kernel_cache, key_cache, _, _, binder = jit.device_caches[device]
    bound, spec, options = binder(*a, **kw)
    key = compute_cache_key(key_cache, spec, options)
    kernel = kernel_cache[key]
    grid = grid(bound) if callable(grid) else grid
    g = tuple(grid) + (1,) * (3 - len(grid))
    values = tuple(bound.values())
    meta = kernel.launch_metadata(grid, stream, *values)
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return {
        "kernel[grid](...)": per_call_us(lambda: jit.run(*a, grid=grid, warmup=False, **full), loops),
        "device + stream": per_call_us(lambda: driver.active.get_current_stream(driver.active.get_current_device()), loops),
        "binder": per_call_us(lambda: binder(*a, **kw), loops),
        "cache key": per_call_us(lambda: compute_cache_key(key_cache, spec, options), loops),
        "launch_metadata": per_call_us(lambda: kernel.launch_metadata(grid, stream, *values), loops),
        "C launcher": per_call_us(lambda: kernel.run(*g, stream, kernel.function, kernel.packed_metadata, meta,
                                                *hooks, *values), loops),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b")
    p.add_argument("--backend", default="auto")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per call (small: the GPU work does not matter)")
    p.add_argument("--loops", type=int, default=20)
    o = p.parse_args()
    for shape in layer_ab.gpu_shapes(o.shapes, "scripts/launch_cost.py"):
        s = bench.shape_at(shape, o.tokens)
        args = bench.layer_inputs(s, "balanced", torch.Generator(device="cuda").manual_seed(0))
        fn = bench.ours(o.backend)
        for _ in range(3):  # autotuning, auto's measurement, the allocator
            _call(fn, args)
        torch.cuda.synchronize()
        launches = _record(fn, args)
        print(f"== {shape} at {o.tokens} tokens, ours ({o.backend}): {len(launches)} launches per call; host us "
              f"per launch (medians of {o.loops} x {BATCH})", flush=True)
        names = None
        totals: dict = {}
        for jit, a, kw in launches:
            row = _pieces(jit, a, kw, o.loops)
            if names is None:
                names = list(row)
                print(f"{'kernel':34s} " + " ".join(f"{n:>17s}" for n in names))
            print(f"{jit.fn.__name__[:34]:34s} " + " ".join(f"{row[n]:17.1f}" for n in names), flush=True)
            for n in names:
                totals[n] = totals.get(n, 0.0) + row[n]
        print(f"{'sum per layer call':34s} " + " ".join(f"{totals[n]:17.1f}" for n in names))
        x = args[0]
        from triton.tools.tensor_descriptor import TensorDescriptor

        def dev_ctx():
            with torch.cuda.device(x.device):
                pass
        others = {
            "torch.cuda.device(dev) enter+exit": dev_ctx,
            "torch.empty [T, H] bf16": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
            "x.contiguous()": lambda: x.contiguous(),
            "TensorDescriptor(x, ...)": lambda: TensorDescriptor(x, list(x.shape), [x.shape[1], 1], [128, 64]),
            "torch.add(x, x)": lambda: torch.add(x, x),
        }
        for name, f in others.items():
            print(f"{name:40s} {per_call_us(f, o.loops):8.1f} us", flush=True)
        del args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
