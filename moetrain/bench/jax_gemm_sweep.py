"""`moetrain bench jax --sweep`: each kernel of the JAX grouped GEMM alone over candidate tiles, beside the same GEMM
through torch._grouped_mm, so one GPU call shows which tiles to make the defaults. The kernels: those of impl
"triton" (moetrain.jax.triton_gemm, ROWS_TILES / WGRAD_TILES) and of impl "pallas" (moetrain.jax.grouped_gemm,
FWD_TILES / DGRAD_TILES / WGRAD_TILES), as --impls names them.

Per shape, the FC1 GEMM of the routed experts (M = T x K rows in E even groups, N = 2I, K = H), bf16:
    fwd    y [M, N] = x [M, H] . w [E, N, H]^T
    dgrad  dx [M, H] = dy [M, N] . w [E, N, H]
    wgrad  dw [E, N, H] = dy^T . x over each group's rows
TFLOP/s counts 2 M N H for each. A candidate that fails to compile (shared memory, registers) prints its error and
the sweep goes on.
"""

from __future__ import annotations

from moetrain.bench.jax_gemm import _timed, group_sizes
from moetrain.kernels.grouped_gemm_configs import GemmConfig

# impl "triton" (the torch kernels' pointer-load configs; the wgrad tiles are dw tiles over N x K, block_k rows).
TRITON_ROW_CANDIDATES = (
    GemmConfig(128, 256, 64, 3, 8, use_tma=False),
    GemmConfig(128, 128, 64, 4, 4, use_tma=False),
    GemmConfig(128, 128, 64, 4, 8, use_tma=False),
    GemmConfig(64, 256, 64, 4, 4, use_tma=False),
    GemmConfig(256, 128, 64, 3, 8, use_tma=False),
)
TRITON_WGRAD_CANDIDATES = (
    GemmConfig(128, 256, 64, 3, 8, use_tma=False),
    GemmConfig(128, 128, 64, 4, 4, use_tma=False),
    GemmConfig(128, 128, 64, 4, 8, use_tma=False),
    GemmConfig(256, 128, 64, 3, 8, use_tma=False),
)
# impl "pallas": rows kernels (fwd and dgrad): the default first, then one change each from it.
ROW_CANDIDATES = (
    dict(),
    dict(group_m=1),
    dict(block_n=256),
    dict(num_stages=4),
    dict(block_m=64, block_n=256, num_warps=4),
    dict(block_n=256, block_k=32, num_stages=4),
)
WGRAD_CANDIDATES = (
    dict(block_m=64, block_n=128, block_k=128),
    dict(block_m=64, block_n=128, block_k=256),
    dict(block_m=128, block_n=128, block_k=128),
    dict(block_m=64, block_n=256, block_k=128),
)


def _tiles_text(tiles) -> str:
    return (f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}"
            f" g{tiles.group_m}")


def _torch_rates(M: int, N: int, H: int, E: int) -> dict[str, float]:
    """TFLOP/s of the three GEMMs through torch._grouped_mm on the same shapes."""
    import torch

    dev = torch.device("cuda")
    x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, H, device=dev, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    offs = torch.tensor(group_sizes(M, E), device=dev).cumsum(0).to(torch.int32)
    calls = {
        "fwd": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
        "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
        "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
    }
    rates = {}
    for kind, call in calls.items():
        def timed_call(call=call):
            call()
            torch.cuda.synchronize()
        rates[kind] = 2 * M * N * H / _timed(timed_call) / 1e12
    return rates


def _jax_rate(impl: str, kind: str, tiles, arrays, flop: float) -> str:
    import jax
    import jax.numpy as jnp

    from moetrain.jax import triton_gemm
    from moetrain.jax.grouped_gemm import pallas_kernel

    x, w, dy, gs = arrays
    a, b = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (dy, x)}[kind]
    if impl == "pallas":
        run = jax.jit(lambda a, b, gs: pallas_kernel(kind, a, b, gs, tiles))
    elif kind == "wgrad":
        run = jax.jit(lambda a, b, gs: triton_gemm.wgrad_call(a, b, jnp.cumsum(gs), tiles=tiles))
    else:
        run = jax.jit(lambda a, b, gs: triton_gemm.rows_call(a, b, jnp.cumsum(gs), dgrad=kind == "dgrad", tiles=tiles))
    try:
        seconds = _timed(lambda: jax.block_until_ready(run(a, b, gs)))
    except Exception as err:  # a candidate that does not compile is a result of the sweep
        return f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return f"{flop / seconds / 1e12:.0f} TFLOP/s"


def sweep(names, shapes, impls=("triton", "pallas")) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    from moetrain.jax.grouped_gemm import GemmTiles

    for name in names:
        s = shapes[name]
        M, N, H, E = s.T * s.K, 2 * s.I, s.H, s.E
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (M, H), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(keys[1], (E, N, H), jnp.float32) * 0.02).astype(jnp.bfloat16)
        dy = jax.random.normal(keys[2], (M, N), jnp.float32).astype(jnp.bfloat16)
        arrays = (x, w, dy, jnp.asarray(group_sizes(M, E), jnp.int32))
        torch_rates = _torch_rates(M, N, H, E)
        torch.cuda.empty_cache()  # the torch tensors died with the call: their memory back for JAX
        print(f"\n{name}: FC1 (M {M}, N {N}, K {H}, groups {E}); torch._grouped_mm: "
              + ", ".join(f"{k} {v:.0f}" for k, v in torch_rates.items()) + " TFLOP/s", flush=True)
        flop = 2 * M * N * H
        for impl in impls:
            if impl == "triton":
                rows, wgrad = TRITON_ROW_CANDIDATES, TRITON_WGRAD_CANDIDATES
            else:
                rows = [GemmTiles(**changes) for changes in ROW_CANDIDATES]
                wgrad = [GemmTiles(**changes) for changes in WGRAD_CANDIDATES]
            for kind, candidates in (("fwd", rows), ("dgrad", rows), ("wgrad", wgrad)):
                for tiles in candidates:
                    rate = _jax_rate(impl, kind, tiles, arrays, flop)
                    print(f"  {impl:6s} {kind:5s} {_tiles_text(tiles):24s} {rate}", flush=True)
