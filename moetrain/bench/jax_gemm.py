"""The JAX grouped GEMM against JAX's own and torch's: FC1 -> SwiGLU -> FC2 forward + backward, bf16, one GPU.

    moetrain bench jax                       every shape of bench/common.py's SHAPES but deepseek-v3
    moetrain bench jax --shapes gpt-oss-20b --impls pallas,torch
    moetrain bench jax --sweep --shapes deepseek-v3-ep8   each triton / Pallas kernel alone over candidate tiles
                                                          (moetrain/bench/jax_gemm_sweep.py)

Each shape runs M = T x K routed rows in E even groups (the remainder in the last): h = x @ w1[e]^T [M, 2I],
a = silu(gate) * up, y = a @ w2[e]^T; the time is jit(value_and_grad) of sum(y) (forward, dgrad and wgrad of
both GEMMs), and TFLOP/s counts 3 x (2 M H 2I + 2 M I H). Contenders, in one process:

  triton      moetrain.jax.grouped_gemm impl="triton" (the torch side's Triton kernels through jax-triton)
  pallas      moetrain.jax.grouped_gemm impl="pallas" (our kernel through Pallas's Triton lowering)
  xla         moetrain.jax.grouped_gemm impl="xla" (jax.lax.ragged_dot / ragged_dot_general)
  tokamax     tokamax.ragged_dot, where tokamax is installed
  torch       torch._grouped_mm (the peer every other bench page measures against)

An out-of-memory contender is reported as such; the others still run. Timing: after one compiling call, calls
until 1 s has passed (at least 3), the mean.
"""

from __future__ import annotations

import argparse
import os
import time

from moetrain.bench.common import SHAPES, parse_shapes
from moetrain.errors import UserError

IMPLS = ("triton", "pallas", "xla", "tokamax", "torch")
DEFAULT_SHAPES = "deepseek-v3-ep8,qwen3-30b-a3b,mixtral-8x7b,gpt-oss-20b"


def group_sizes(M: int, E: int) -> list[int]:
    sizes = [M // E] * E
    sizes[-1] += M - sum(sizes)
    return sizes


def flops(M: int, H: int, I: int) -> float:
    return 3 * (2 * M * H * 2 * I + 2 * M * I * H)


def _timed(call) -> float:
    """Seconds per call: one call to compile and warm, then calls until 1 s has passed (at least 3)."""
    call()
    n, started = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - started < 1.0:
        call()
        n += 1
    return (time.perf_counter() - started) / n


def jax_layer_time(impl: str, M: int, H: int, I: int, E: int) -> float:
    import jax
    import jax.numpy as jnp

    from moetrain.jax.grouped_gemm import grouped_gemm

    if impl == "tokamax":
        import tokamax

        def gemm(x, w, gs):
            return tokamax.ragged_dot(x, jnp.swapaxes(w, 1, 2), gs)
    else:
        def gemm(x, w, gs):
            return grouped_gemm(x, w, gs, impl=impl)

    keys = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(keys[0], (M, H), jnp.float32) * 0.1).astype(jnp.bfloat16)
    w1 = (jax.random.normal(keys[1], (E, 2 * I, H), jnp.float32) * 0.02).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (E, H, I), jnp.float32) * 0.02).astype(jnp.bfloat16)
    gs = jnp.asarray(group_sizes(M, E), jnp.int32)

    def layer(x, w1, w2):
        gate, up = jnp.split(gemm(x, w1, gs), 2, axis=-1)
        a = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(jnp.bfloat16)
        return gemm(a, w2, gs).astype(jnp.float32).sum()

    step = jax.jit(jax.value_and_grad(layer, argnums=(0, 1, 2)))
    return _timed(lambda: jax.block_until_ready(step(x, w1, w2)))


def torch_layer_time(M: int, H: int, I: int, E: int) -> float:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    x = (torch.randn(M, H, device=dev) * 0.1).bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * I, H, device=dev) * 0.02).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device=dev) * 0.02).bfloat16().requires_grad_()
    offs = torch.tensor(group_sizes(M, E), device=dev).cumsum(0).to(torch.int32)

    def call():
        gate, up = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
        y.float().sum().backward()
        torch.cuda.synchronize()

    return _timed(call)


def _cell(impl: str, M: int, H: int, I: int, E: int) -> str:
    try:
        seconds = torch_layer_time(M, H, I, E) if impl == "torch" else jax_layer_time(impl, M, H, I, E)
        if impl == "torch":
            import torch

            torch.cuda.empty_cache()  # the tensors died with the call: give the memory back for the JAX contenders
    except ImportError as err:
        return f"not installed ({err.name})"
    except Exception as err:  # out of memory is a result; anything else is a bug and raises
        if "RESOURCE_EXHAUSTED" in str(err) or type(err).__name__ == "OutOfMemoryError":
            return "out of memory"
        raise
    return f"{flops(M, H, I) / seconds / 1e12:.0f} TFLOP/s ({seconds * 1e3:.1f} ms)"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="moetrain bench jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"default: {DEFAULT_SHAPES}")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    parser.add_argument("--sweep", action="store_true",
                        help="instead of the layer table: each kernel of --impls triton / pallas alone over "
                             "candidate tiles")
    args = parser.parse_args(argv)
    names = parse_shapes(args.shapes)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise UserError(f"--impls {args.impls}: valid: {', '.join(IMPLS)}")
    kernels = [i for i in impls if i in ("triton", "pallas")]
    if args.sweep and not kernels:
        raise UserError(f"--sweep times the triton and pallas kernels; --impls {args.impls} names neither")
    from moetrain.jax import require_jax

    require_jax()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process
    import jax

    if jax.default_backend() != "gpu":
        raise UserError(f"moetrain bench jax needs a GPU for JAX (its backend here is {jax.default_backend()})")
    if args.sweep:
        from moetrain.bench.jax_gemm_sweep import sweep

        print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {' and '.join(kernels)} kernels alone, bf16",
              flush=True)
        return sweep(names, SHAPES, kernels)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; FC1 -> SwiGLU -> FC2 fwd+bwd, bf16", flush=True)
    print("| shape (rows M, hidden H, intermediate I, experts E) | " + " | ".join(impls) + " |")
    print("|---" * (len(impls) + 1) + "|")
    for name in names:
        s = SHAPES[name]
        M = s.T * s.K
        cells = [_cell(impl, M, s.H, s.I, s.E) for impl in impls]
        print(f"| {name} ({M}, {s.H}, {s.I}, {s.E}) | " + " | ".join(cells) + " |", flush=True)
