"""The grouped GEMM's GPU kernels for JAX: the torch side's Triton kernels (moetrain.kernels.grouped_gemm_kernels),
called from jit through jax-triton. ``grouped_gemm(..., impl="triton")`` uses them; this module is its GPU half.

Shapes and dtypes (M rows sorted by group, G groups; as moetrain.jax.grouped_gemm)
    fwd    y  [M, N] = x  [M, K] . w[g] [N, K]^T     rows_call(x, w, ends, dgrad=False)
    dgrad  dx [M, K] = dy [M, N] . w[g] [N, K]       rows_call(dy, w, ends, dgrad=True)
    wgrad  dw [G, N, K] = dy_g^T . x_g               wgrad_call(dy, x, ends)
    ends   [G] int32, the cumulative row ends (cumsum of group_sizes); rows past ends[-1] are padding: zero rows of
           y / dx, no contribution to dw. x, w, dy: bfloat16 or float32 (one dtype), row-major.

Why these kernels: they are the ones the torch backend runs (tuned on Hopper, persistent, sync-free: each program
reads ``ends`` on the device and walks its tiles), compiled by the pip Triton the torch side uses. Only their
pointer-load variant (USE_TMA=False) is reachable: jax-triton passes arrays and scalars, not TMA descriptors. The
wrapper kernels below fix the torch kernels' other constexprs (no gather, no tail split, no skew schedule) and put
the output pointer last, where jax-triton appends its outputs.

Tiles: the torch side's own ``GemmConfig`` (moetrain.kernels.grouped_gemm_configs), its pointer-load configs only
(use_tma False, no tail split, one program per SM, kernel "triton"): rows kernels block_m rows x block_n output
columns, block_k reduction step, bands of group_m row tiles; wgrad block_m (over N) x block_n (over K) dw tiles,
block_k group rows per reduction step, bands of group_m dw row tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moetrain.kernels.grouped_gemm_configs import GemmConfig
from moetrain.kernels.grouped_gemm_kernels import _rowgroup_kernel, _wgrad_kernel, block_g
from moetrain.kernels.host import cdiv

# float32 products at IEEE precision (the contract of moetrain.jax.grouped_gemm, as the XLA path's HIGHEST); bfloat16
# dots ignore it.
PRECISION = "ieee"


# The torch side's pointer-load candidate that leads on Hopper (grouped_gemm_configs: 128x256x64/s3/w8/ptr).
ROWS_TILES = GemmConfig(128, 256, 64, 3, 8, use_tma=False)
WGRAD_TILES = GemmConfig(128, 256, 64, 3, 8, use_tma=False)


def check_tiles(tiles: GemmConfig) -> None:
    """One-line ValueError for a config the wrapper kernels do not run (they fix USE_TMA, PART and MIX)."""
    if (tiles.use_tma or tiles.tail_split or tiles.mix or tiles.kernel != "triton" or tiles.programs_per_sm != 1):
        raise ValueError(f"JAX grouped GEMM through jax-triton: config {tiles} is not a pointer-load config of the "
                         "Triton kernels (use_tma=False, no tail split, no mix, one program per SM)")


@triton.jit
def rows_kernel(a_ptr, w_ptr, ends_ptr, M, G, NUM_PROGS, out_ptr,
                OUT: tl.constexpr, RED: tl.constexpr, STRIDE_AM: tl.constexpr, STRIDE_WG: tl.constexpr,
                STRIDE_W1: tl.constexpr, STRIDE_OM: tl.constexpr,
                DGRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr, PRECISION: tl.constexpr, FLATTEN: tl.constexpr):
    """_rowgroup_kernel with pointer loads, every row in one launch (PART 0), groups in order, rows not gathered."""
    _rowgroup_kernel(a_ptr, a_ptr, ends_ptr, w_ptr, w_ptr, out_ptr, out_ptr, ends_ptr, ends_ptr, M, OUT, RED, G,
                     STRIDE_AM, STRIDE_WG, STRIDE_W1, STRIDE_OM, NUM_PROGS, DGRAD, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                     BLOCK_G, False, FLATTEN, PRECISION, False, 0, BLOCK_M, False)


@triton.jit
def wgrad_kernel(dy_ptr, x_ptr, ends_ptr, M, G, NUM_PROGS, dw_ptr,
                 N: tl.constexpr, K: tl.constexpr, STRIDE_DYM: tl.constexpr, STRIDE_XM: tl.constexpr,
                 STRIDE_DWG: tl.constexpr, STRIDE_DWN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_N: tl.constexpr, BLOCK_G: tl.constexpr, PRECISION: tl.constexpr):
    """_wgrad_kernel with pointer loads and register stores, rows not gathered."""
    _wgrad_kernel(dy_ptr, dy_ptr, x_ptr, x_ptr, ends_ptr, dw_ptr, dw_ptr, ends_ptr, M, N, K, G,
                  STRIDE_DYM, STRIDE_XM, STRIDE_DWG, STRIDE_DWN, NUM_PROGS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N,
                  BLOCK_G, False, PRECISION, False, False)


def rows_args(M: int, RED: int, w_shape: tuple, dgrad: bool, num_programs: int, tiles: GemmConfig):
    """(runtime scalars M, G, NUM_PROGS; grid size; constexprs) of one rows_kernel launch over a contiguous [M, RED]
    operand and w [G, D1, D2]. The persistent grid is at most the tile count's bound without reading ends."""
    G, D1, D2 = w_shape
    out = D2 if dgrad else D1
    bound = (cdiv(M, tiles.block_m) + G) * cdiv(out, tiles.block_n)
    nprog = max(1, min(num_programs, bound))
    consts = dict(OUT=out, RED=RED, STRIDE_AM=RED, STRIDE_WG=D1 * D2, STRIDE_W1=D2, STRIDE_OM=out, DGRAD=dgrad,
                  BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
                  BLOCK_G=block_g(G), PRECISION=PRECISION)
    return (M, G, nprog), nprog, consts


def wgrad_args(M: int, N: int, K: int, G: int, num_programs: int, tiles: GemmConfig):
    """(runtime scalars M, G, NUM_PROGS; grid size; constexprs) of one wgrad_kernel launch: dy [M, N], x [M, K]."""
    nprog = max(1, min(num_programs, G * cdiv(N, tiles.block_m) * cdiv(K, tiles.block_n)))
    consts = dict(N=N, K=K, STRIDE_DYM=N, STRIDE_XM=K, STRIDE_DWG=N * K, STRIDE_DWN=K, BLOCK_M=tiles.block_m,
                  BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_N=tiles.group_m, BLOCK_G=block_g(G),
                  PRECISION=PRECISION)
    return (M, G, nprog), nprog, consts


def rows_call(a, w, ends, *, dgrad: bool, tiles: GemmConfig = ROWS_TILES):
    """y = a . w[g]^T (forward) or dx = a . w[g] (dgrad), through jax-triton; shapes in the module doc."""
    import jax
    import jax.numpy as jnp

    jt = _jax_triton()
    M, RED = a.shape
    check_tiles(tiles)
    scalars, nprog, consts = rows_args(M, RED, w.shape, dgrad, _sm_count(), tiles)
    out_shape = jax.ShapeDtypeStruct((M, consts["OUT"]), a.dtype)
    if 0 in (M, RED, *w.shape):  # nothing to launch: the product is empty or all zeros
        return jnp.zeros(out_shape.shape, a.dtype)
    return jt.triton_call(a, w, ends, *scalars, kernel=rows_kernel, out_shape=out_shape, grid=(nprog,),
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                          name="moetrain_grouped_gemm_dgrad" if dgrad else "moetrain_grouped_gemm_fwd",
                          FLATTEN=True, **consts)


def wgrad_call(dy, x, ends, *, tiles: GemmConfig = WGRAD_TILES):
    """dw [G, N, K] = dy_g^T . x_g through jax-triton; empty groups give zeros."""
    import jax
    import jax.numpy as jnp

    jt = _jax_triton()
    check_tiles(tiles)
    (M, N), K, G = dy.shape, x.shape[1], ends.shape[0]
    if 0 in (M, N, K, G):  # nothing to launch: dw is empty or all zeros
        return jnp.zeros((G, N, K), dy.dtype)
    scalars, nprog, consts = wgrad_args(M, N, K, G, _sm_count(), tiles)
    return jt.triton_call(dy, x, ends, *scalars, kernel=wgrad_kernel,
                          out_shape=jax.ShapeDtypeStruct((G, N, K), dy.dtype), grid=(nprog,),
                          num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                          name="moetrain_grouped_gemm_wgrad", **consts)


def _sm_count() -> int:
    """The persistent grid's program count: the GPU's SMs (132 on an H100 / H200 where jax's device does not say;
    the grid size changes how the tiles are shared out, never the result)."""
    import jax

    return getattr(jax.devices()[0], "core_count", None) or 132


def _jax_triton():
    try:
        import jax_triton
    except ImportError as err:
        raise ImportError(f'grouped_gemm impl="triton" needs jax-triton and a GPU jaxlib (pip install -e ".[jax]"): '
                          f'{err}') from err
    return jax_triton
