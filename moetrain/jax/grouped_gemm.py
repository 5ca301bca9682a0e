"""Grouped GEMM for the MoE experts, with a custom VJP: ``grouped_gemm(x, w, group_sizes, *, impl="auto")``.

Shapes and dtypes
    x           [M, K]     bfloat16, float32 or float64 (the rows, sorted by group)
    w           [G, N, K]  same dtype as x; torch layout, one [out, in] matrix per group (as the torch experts'
                           w1 [E, 2I, H] and w2 [E, H, I])
    group_sizes [G]        integer (used as int32); rows 0..gs[0]-1 belong to group 0, the next gs[1] to group 1, ...
                           sum(group_sizes) <= M; the rows past the sum are padding
    y           [M, N]     x.dtype

The math
    y[r] = x[r] @ w[g(r)].T for the rows r of group g(r); padding rows give zero rows. The products accumulate in
    float32 (float64 for float64 inputs), at full precision (no TF32 for float32), and are rounded once to x.dtype.

The backward (jax.custom_vjp; group_sizes gets no gradient)
    dgrad  dx[r] = dy[r] @ w[g(r)]                    (padding rows: zero)
    wgrad  dw[g] = sum over rows r of group g of dy[r]^T x[r]   -> [G, N, K], the reduction length varies per group

Implementations (``impl``)
    "xla"    jax.lax.ragged_dot_general for all three GEMMs; the wgrad is the ragged *contraction* (the ragged
             dimension is a contracting one, the group dimension appears in the output). Runs on every backend,
             under jit with static shapes, and never reads group_sizes on the host. This is the reference.
    "pallas" Pallas kernels for forward, dgrad and wgrad, lowered through Pallas's Triton backend for NVIDIA
             Hopper GPUs; ``interpret=True`` runs the same kernels on the CPU (the default when jax's default
             backend is the CPU). Triton rather than Mosaic GPU: the Triton lowering takes masked loads/stores at any
             row offset (groups start at any row and K needs no padding to the tile), and its interpret mode runs
             these kernels unchanged on a CPU, so they are tested here; Mosaic GPU (wgmma/TMA pipelines, as in jax's
             own ragged_dot_mgpu) may be faster on Hopper and is the candidate to measure against on the GPU.
             The Triton CompilerParams passed to every pallas_call are what select the Triton lowering on a GPU.
    "triton" the torch backend's Triton kernels (moetrain.kernels.grouped_gemm_kernels, pointer loads) through
             jax-triton, compiled by the pip Triton: moetrain.jax.triton_gemm. GPU only; bfloat16 and float32.
    "auto"   "triton" on a GPU backend (float64: "xla"), "xla" elsewhere.

Pallas schedule (sync-free, all on the device under jit)
    forward/dgrad: the rows are cut into tiles of at most block_m rows that never straddle a group: group g gives
    cdiv(gs[g], block_m) tiles starting at its first row. The padding rows form one more group whose tiles store
    zeros. The grid has the static worst case cdiv(M, block_m) + G row tiles; a schedule of per-tile (group, row
    start, row end) is computed from group_sizes, and tiles past the real count have an empty row range (they store
    nothing). Each program computes a block_m x block_n output tile with a K loop of block_k steps in fp32.
    The launch order is grouped (``group_m`` row tiles x every column tile, then the next ``group_m`` row tiles), so
    the programs running at once share their row tiles and weight tiles through L2 instead of re-reading x from
    memory once per column tile.
    wgrad: one program per (N tile, K tile, group), the group slowest, so the programs running at once read the same
    group's rows of dy and x (from L2 after the first) instead of every group's rows once per output tile.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from moetrain.errors import UserError

__all__ = ["DGRAD_TILES", "FWD_TILES", "WGRAD_TILES", "GemmTiles", "grouped_gemm", "grouped_gemm_reference",
           "pallas_kernel"]

IMPLS = ("auto", "xla", "pallas", "triton")
DTYPES = (jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Tile sizes (powers of 2) and Triton launch options of one Pallas kernel.

    forward/dgrad: block_m rows x block_n output columns per program, block_k reduction step, launched in bands of
    group_m row tiles.
    wgrad: block_n (over N) x block_k (over K) output tile per program, block_m rows per reduction step."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8


# Typical Hopper starting points; to be tuned on the GPU (see the module docstring).
FWD_TILES = GemmTiles()
DGRAD_TILES = GemmTiles()
WGRAD_TILES = GemmTiles(block_m=64, block_n=128, block_k=128)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static (hashable) choices of one call: the custom_vjp's non-differentiable argument."""

    impl: str
    fwd: GemmTiles
    dgrad: GemmTiles
    wgrad: GemmTiles
    interpret: bool


def grouped_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "auto",
                 fwd_tiles: GemmTiles = FWD_TILES, dgrad_tiles: GemmTiles = DGRAD_TILES,
                 wgrad_tiles: GemmTiles = WGRAD_TILES, interpret: bool | None = None) -> jax.Array:
    """y[r] = x[r] @ w[g(r)].T: x [M, K], w [G, N, K], group_sizes [G] -> y [M, N] in x.dtype (see the module doc).

    impl: "xla", "pallas", "triton" or "auto" (triton on GPU). The tiles and ``interpret`` (default: True on a CPU
    backend) apply to "pallas" only; "triton" runs moetrain.jax.triton_gemm's tiles."""
    group_sizes = jnp.asarray(group_sizes)
    _check_inputs(x, w, group_sizes, impl)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    plan = _Plan(_resolve_impl(impl, x.dtype), fwd_tiles, dgrad_tiles, wgrad_tiles, bool(interpret))
    if plan.impl == "triton":
        _check_triton_impl(x)
    if plan.impl == "pallas":
        for tiles in (fwd_tiles, dgrad_tiles, wgrad_tiles):
            _check_tiles(tiles)
    return _grouped_gemm(x, w, group_sizes.astype(jnp.int32), plan)


def grouped_gemm_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Plain jnp grouped GEMM for the tests: a one-hot row -> group mask, float32 (float64) math, x.dtype out.

    Costs G x the dense GEMM; differentiable by ordinary autodiff."""
    _check_inputs(x, w, group_sizes, "xla")
    acc = _acc_dtype(x.dtype)
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    group_of_row = jnp.sum(jnp.arange(x.shape[0])[:, None] >= ends[None, :], axis=1)  # G for padding rows
    onehot = (group_of_row[:, None] == jnp.arange(w.shape[0])[None, :]).astype(acc)  # padding rows: all zero
    y = jnp.einsum("mg,mk,gnk->mn", onehot, x.astype(acc), w.astype(acc), precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


# ---------------------------------------------------------------------------------------------------- checks


def _check_inputs(x: jax.Array, w: jax.Array, group_sizes: jax.Array, impl: str) -> None:
    """One-line ValueErrors naming the shapes or dtypes that do not fit."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_gemm: impl {impl!r} is not one of {IMPLS}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not match ([M, K], [G, N, K])")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_gemm: group_sizes {tuple(group_sizes.shape)} {group_sizes.dtype} must be an "
                         f"integer [G] = [{w.shape[0]}] for w {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"grouped_gemm: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype} must share "
                         f"one dtype of bfloat16, float32, float64")


KERNELS = ("fwd", "dgrad", "wgrad")


def pallas_kernel(kind: str, a: jax.Array, b: jax.Array, group_sizes: jax.Array, tiles: GemmTiles, *,
                  interpret: bool = False) -> jax.Array:
    """One of the three Pallas kernels alone, as ``moetrain bench jax --sweep`` times them:
    "fwd"   a = x [M, K], b = w [G, N, K] -> y [M, N]
    "dgrad" a = dy [M, N], b = w [G, N, K] -> dx [M, K]
    "wgrad" a = dy [M, N], b = x [M, K] -> dw [G, N, K]"""
    if kind not in KERNELS:
        raise ValueError(f"pallas_kernel: kind {kind!r}; valid: {', '.join(KERNELS)}")
    _check_tiles(tiles)
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    if kind == "fwd":
        return _pallas_forward(a, b, group_sizes, tiles, interpret)
    if kind == "dgrad":
        return _pallas_dgrad(a, b, group_sizes, tiles, interpret)
    return _pallas_wgrad(a, b, group_sizes, tiles, interpret)


def _check_triton_impl(x: jax.Array) -> None:
    if jax.default_backend() != "gpu":
        raise ValueError(f'grouped_gemm: impl "triton" runs on a GPU backend only (this one is '
                         f'{jax.default_backend()}); impl "xla" runs everywhere')
    if x.dtype == jnp.float64:
        raise ValueError('grouped_gemm: impl "triton" computes bfloat16 and float32; for float64 use impl "xla"')
    if importlib.util.find_spec("jax_triton") is None:
        raise UserError('the JAX grouped GEMM on GPUs (impl "triton", the default there) needs jax-triton, which is '
                        'not installed: pip install -e ".[jax]"')


def _check_tiles(tiles: GemmTiles) -> None:
    """Triton's tensors must have power-of-2 sizes; so must every tile dimension."""
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(tiles, name)
        if size < 1 or size & (size - 1):
            raise ValueError(f"grouped_gemm: {name}={size} in {tiles} must be a power of 2")
    if tiles.group_m < 1:
        raise ValueError(f"grouped_gemm: group_m={tiles.group_m} in {tiles} must be at least 1")


def _resolve_impl(impl: str, dtype) -> str:
    if impl == "auto":
        return "triton" if jax.default_backend() == "gpu" and dtype != jnp.float64 else "xla"
    return impl


def _acc_dtype(dtype) -> jnp.dtype:
    """float32 accumulation, float64 for float64 inputs."""
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


# ---------------------------------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_gemm(x, w, group_sizes, plan: _Plan):
    return _forward(x, w, group_sizes, plan)


def _grouped_gemm_fwd(x, w, group_sizes, plan: _Plan):
    return _forward(x, w, group_sizes, plan), (x, w, group_sizes)


def _grouped_gemm_bwd(plan: _Plan, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    if plan.impl == "pallas":
        dx = _pallas_dgrad(dy, w, group_sizes, plan.dgrad, plan.interpret)
        dw = _pallas_wgrad(dy, x, group_sizes, plan.wgrad, plan.interpret)
    elif plan.impl == "triton":
        from moetrain.jax import triton_gemm

        ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
        dx = triton_gemm.rows_call(dy, w, ends, dgrad=True)
        dw = triton_gemm.wgrad_call(dy, x, ends)
    else:
        dx = _xla_dgrad(dy, w, group_sizes)
        dw = _xla_wgrad(dy, x, group_sizes)
    return dx, dw, None  # None: no cotangent for the integer group_sizes


_grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)


def _forward(x, w, group_sizes, plan: _Plan):
    if plan.impl == "pallas":
        return _pallas_forward(x, w, group_sizes, plan.fwd, plan.interpret)
    if plan.impl == "triton":
        from moetrain.jax import triton_gemm

        return triton_gemm.rows_call(x, w, jnp.cumsum(group_sizes, dtype=jnp.int32), dgrad=False)
    return _xla_forward(x, w, group_sizes)


# ---------------------------------------------------------------------------------------------------- XLA


def _ragged(lhs, rhs, group_sizes, contracting, rhs_group_dims, out_dtype):
    """ragged_dot_general with lhs dim 0 ragged, full-precision products accumulated in _acc_dtype."""
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(contracting, ((), ())),
                                         lhs_ragged_dimensions=[0], rhs_group_dimensions=rhs_group_dims)
    out = lax.ragged_dot_general(lhs, rhs, group_sizes, dims, precision=lax.Precision.HIGHEST,
                                 preferred_element_type=_acc_dtype(lhs.dtype))
    return out.astype(out_dtype)


def _xla_forward(x, w, group_sizes):
    """y [M, N] = x [M, K] . w[g] [N, K] over K; rows ragged, w's dim 0 the group."""
    return _ragged(x, w, group_sizes, ((1,), (2,)), [0], x.dtype)


def _xla_dgrad(dy, w, group_sizes):
    """dx [M, K] = dy [M, N] . w[g] [N, K] over N."""
    return _ragged(dy, w, group_sizes, ((1,), (1,)), [0], dy.dtype)


def _xla_wgrad(dy, x, group_sizes):
    """dw [G, N, K] = dy [M, N] . x [M, K] over M: the ragged dim is contracting, so G leads the output."""
    return _ragged(dy, x, group_sizes, ((0,), (0,)), [], x.dtype)


# ---------------------------------------------------------------------------------------------------- Pallas


def _group_bounds(group_sizes, m: int):
    """Per-group row [start, end), clipped to M (so an oversized sum cannot address rows past M)."""
    ends = jnp.minimum(jnp.cumsum(group_sizes, dtype=jnp.int32), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def _row_tile_schedule(group_sizes, m: int, block_m: int):
    """Per row tile t < cdiv(M, block_m) + G: (group, row start, row end).

    Groups 0..G-1 are the real ones, group G the padding rows [sum, M) (tiles that store zeros). A group of s rows
    has cdiv(s, block_m) tiles, which sum to at most cdiv(M, block_m) + G over the G + 1 groups. Tiles past that
    real count get group G and the empty range [M, M): they store nothing."""
    num_groups = group_sizes.shape[0]
    starts, ends = _group_bounds(group_sizes, m)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    tiles_per_group = (ends - starts + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles_per_group, dtype=jnp.int32)
    num_tiles = pl.cdiv(m, block_m) + num_groups
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.sum(t[:, None] >= tile_ends[None, :], axis=1).astype(jnp.int32)  # G + 1 past the real tiles
    used = group <= num_groups
    group = jnp.minimum(group, num_groups)
    row_start = starts[group] + (t - (tile_ends[group] - tiles_per_group[group])) * block_m
    row_end = jnp.minimum(row_start + block_m, ends[group])
    return group, jnp.where(used, row_start, m), jnp.where(used, row_end, m)


def _dot(a, b, contracting, acc_dtype):
    """One tile product in acc_dtype; HIGHEST keeps float32 at IEEE precision (Triton would use TF32)."""
    return lax.dot_general(a, b, (contracting, ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=acc_dtype)


def _grouped_order(pid, num_rows: int, num_cols: int, group_m: int):
    """Program pid of a 1-D launch -> (row tile, column tile): bands of group_m row tiles, each band's tiles column
    by column (the row tile fastest), the last band narrower where num_rows is not a multiple of group_m."""
    band = pid // (group_m * num_cols)
    first = band * group_m
    height = jnp.minimum(num_rows - first, group_m)
    local = pid - band * group_m * num_cols
    return first + local % height, local // height


def _rows_kernel(group_ref, start_ref, end_ref, a_ref, w_ref, out_ref, *, tiles: GemmTiles, w_transposed: bool):
    """out[r, cols] = a[r, :] . w[g] over the reduction for one (row tile, column tile): program_id 0 of a 1-D launch
    in the grouped order (_grouped_order).

    Forward: a = x [M, K], w[g] = [N, K] (reduce over its dim 1, w_transposed). Dgrad: a = dy [M, N],
    w[g] = [N, K] (reduce over its dim 0)."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    num_groups, reduce_len, out_cols = w_ref.shape[0], a_ref.shape[1], out_ref.shape[1]
    t, j = _grouped_order(pl.program_id(0), group_ref.shape[0], pl.cdiv(out_cols, bn), tiles.group_m)
    group, r0, r1 = group_ref[t], start_ref[t], end_ref[t]
    acc_dtype = _acc_dtype(out_ref.dtype)
    row_ok = (r0 + jnp.arange(bm, dtype=jnp.int32) < r1)[:, None]
    col_ok = j * bn + jnp.arange(bn, dtype=jnp.int32) < out_cols
    wg = jnp.minimum(group, num_groups - 1)  # padding/unused tiles (group G) run no K step
    # A multiply, not jnp.where: the Triton lowering of jnp.where with two literal ints produced an i1 bound.
    num_steps = (group < num_groups).astype(jnp.int32) * pl.cdiv(reduce_len, bk)

    def step(s, acc):
        k_ok = s * bk + jnp.arange(bk, dtype=jnp.int32) < reduce_len
        a = plt.load(a_ref.at[pl.ds(r0, bm), pl.ds(s * bk, bk)], mask=row_ok & k_ok[None, :], other=0)
        if w_transposed:
            b = plt.load(w_ref.at[wg, pl.ds(j * bn, bn), pl.ds(s * bk, bk)],
                         mask=col_ok[:, None] & k_ok[None, :], other=0)
            return acc + _dot(a, b, ((1,), (1,)), acc_dtype)
        b = plt.load(w_ref.at[wg, pl.ds(s * bk, bk), pl.ds(j * bn, bn)], mask=k_ok[:, None] & col_ok[None, :], other=0)
        return acc + _dot(a, b, ((1,), (0,)), acc_dtype)

    acc = lax.fori_loop(0, num_steps, step, jnp.zeros((bm, bn), acc_dtype))
    plt.store(out_ref.at[pl.ds(r0, bm), pl.ds(j * bn, bn)], acc.astype(out_ref.dtype), mask=row_ok & col_ok[None, :])


def _rows_gemm(a, w, group_sizes, out_cols: int, tiles: GemmTiles, interpret: bool, w_transposed: bool):
    """The forward (w_transposed) or dgrad launch: grid (row tiles, column tiles) over out [M, out_cols]."""
    m = a.shape[0]
    schedule = _row_tile_schedule(group_sizes, m, tiles.block_m)
    kernel = functools.partial(_rows_kernel, tiles=tiles, w_transposed=w_transposed)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, out_cols), a.dtype),
        grid=(schedule[0].shape[0] * pl.cdiv(out_cols, tiles.block_n),),
        compiler_params=plt.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="grouped_gemm_fwd" if w_transposed else "grouped_gemm_dgrad",
    )(*schedule, a, w)


def _pallas_forward(x, w, group_sizes, tiles: GemmTiles, interpret: bool):
    return _rows_gemm(x, w, group_sizes, w.shape[1], tiles, interpret, w_transposed=True)


def _pallas_dgrad(dy, w, group_sizes, tiles: GemmTiles, interpret: bool):
    return _rows_gemm(dy, w, group_sizes, w.shape[2], tiles, interpret, w_transposed=False)


def _wgrad_kernel(start_ref, end_ref, dy_ref, x_ref, dw_ref, *, tiles: GemmTiles):
    """dw[g, n tile, k tile] = sum over the rows of group g of dy[r, n]^T x[r, k]; an empty group stores zeros."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    i, j, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r0, r1 = start_ref[g], end_ref[g]
    n_ok = i * bn + jnp.arange(bn, dtype=jnp.int32) < dw_ref.shape[1]
    k_ok = j * bk + jnp.arange(bk, dtype=jnp.int32) < dw_ref.shape[2]
    acc_dtype = _acc_dtype(dw_ref.dtype)

    def step(s, acc):
        row0 = r0 + s * bm
        row_ok = (row0 + jnp.arange(bm, dtype=jnp.int32) < r1)[:, None]
        dy = plt.load(dy_ref.at[pl.ds(row0, bm), pl.ds(i * bn, bn)], mask=row_ok & n_ok[None, :], other=0)
        x = plt.load(x_ref.at[pl.ds(row0, bm), pl.ds(j * bk, bk)], mask=row_ok & k_ok[None, :], other=0)
        return acc + _dot(dy, x, ((0,), (0,)), acc_dtype)

    acc = lax.fori_loop(0, (r1 - r0 + bm - 1) // bm, step, jnp.zeros((bn, bk), acc_dtype))
    plt.store(dw_ref.at[g, pl.ds(i * bn, bn), pl.ds(j * bk, bk)], acc.astype(dw_ref.dtype),
              mask=n_ok[:, None] & k_ok[None, :])


def _pallas_wgrad(dy, x, group_sizes, tiles: GemmTiles, interpret: bool):
    """dw [G, N, K]: grid (N tiles, K tiles, G), the group slowest; rows past sum(group_sizes) are never read."""
    (m, n), k, num_groups = dy.shape, x.shape[1], group_sizes.shape[0]
    starts, ends = _group_bounds(group_sizes, m)
    return pl.pallas_call(
        functools.partial(_wgrad_kernel, tiles=tiles),
        out_shape=jax.ShapeDtypeStruct((num_groups, n, k), x.dtype),
        grid=(pl.cdiv(n, tiles.block_n), pl.cdiv(k, tiles.block_k), num_groups),
        compiler_params=plt.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="grouped_gemm_wgrad",
    )(starts, ends, dy, x)
