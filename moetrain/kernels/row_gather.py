"""Gathered rows for Hopper GEMMs: one TMA copy per row into a 128-byte-swizzled [BM, 64] bf16 stage (Gluon).

    gather_rows(desc, rows_ptr, first, last, k0, bar, stage, R0, NROWS)
        stage[r, :] = src[rows_ptr[min(first + r, last)], k0:k0 + 64]    for r in [R0, R0 + NROWS)

desc: a TMA descriptor of src [T, K] bf16 with block [1, 64] and the stage's 128-byte-swizzled layout (``row_desc``);
rows_ptr: int32 row indices; bar: the stage's mbarrier, whose expected bytes the caller has set (NROWS * 128 for
this call). NROWS a multiple of 8.

Why: Hopper's TMA reads boxes of consecutive rows and has no gather (Blackwell's gather4 has), so an A operand whose
rows are token rows (x[token_of_row] in FC1) is a permuted copy written first. A box may be a single row, written at
its row of the stage (the unit swizzles by shared address, so the rows land where a whole box puts them). Measured
on the H200 (scripts/tma_gather_probe.py, bench/NOTES.md session 25 A): one warp issuing each copy after its index's
load takes ~15 ns per copy, 3.5x a whole box's time per stage; loading eight indices before eight copies and
splitting a stage's rows over four warps feeds a [128, 64] stage as fast as a whole box (0.54 us per stage per SM,
HBM-bound, against 0.54).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# The stage viewed as unswizzled 128-byte rows: Gluon will not slice a swizzled buffer inside its 8-row swizzle
# atom, and the copies need row r at byte 128 r (the TMA unit applies the descriptor's swizzle by address).
PLAIN_ROWS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
COLUMNS = 64  # one row copy: 64 bf16, the widest row of a 128-byte swizzle
BK = gl.constexpr(COLUMNS)


@gluon.jit
def _eight_rows(desc, idx_ptr, k0, bar, view, r: gl.constexpr):
    """Rows r..r+7 from idx_ptr[r..r+7]: the eight indices loaded before the eight copies, so their loads' latency is
    paid once (an index load ahead of each copy made every copy wait for it). The addresses are one pointer plus
    constants: a clamped address per row was hoisted out of the caller's loop and spilled the loader warps."""
    i0 = gl.load(idx_ptr + r)
    i1 = gl.load(idx_ptr + (r + 1))
    i2 = gl.load(idx_ptr + (r + 2))
    i3 = gl.load(idx_ptr + (r + 3))
    i4 = gl.load(idx_ptr + (r + 4))
    i5 = gl.load(idx_ptr + (r + 5))
    i6 = gl.load(idx_ptr + (r + 6))
    i7 = gl.load(idx_ptr + (r + 7))
    tma.async_copy_global_to_shared(desc, [i0, k0], bar, view.slice(r, 1))
    tma.async_copy_global_to_shared(desc, [i1, k0], bar, view.slice(r + 1, 1))
    tma.async_copy_global_to_shared(desc, [i2, k0], bar, view.slice(r + 2, 1))
    tma.async_copy_global_to_shared(desc, [i3, k0], bar, view.slice(r + 3, 1))
    tma.async_copy_global_to_shared(desc, [i4, k0], bar, view.slice(r + 4, 1))
    tma.async_copy_global_to_shared(desc, [i5, k0], bar, view.slice(r + 5, 1))
    tma.async_copy_global_to_shared(desc, [i6, k0], bar, view.slice(r + 6, 1))
    tma.async_copy_global_to_shared(desc, [i7, k0], bar, view.slice(r + 7, 1))


@gluon.jit
def gather_rows(desc, rows_ptr, first, last, k0, bar, stage, R0: gl.constexpr, NROWS: gl.constexpr):
    gl.static_assert(NROWS % 8 == 0, "rows are copied eight at a time")
    view = stage._reinterpret(gl.bfloat16, stage.type.shape, PLAIN_ROWS)
    if first + (R0 + NROWS - 1) <= last:
        for r in gl.static_range(R0, R0 + NROWS, 8):  # (a shared slice takes a constant start)
            _eight_rows(desc, rows_ptr + first, k0, bar, view, r)
    else:  # the launch's last row tile, past the index's end: the last index stands in (its rows are dropped)
        # (min(first + r, last) spelled so that nothing in it looks step-invariant: hoisted out of the caller's loop,
        # the clamped indices spilled the loader warps)
        last = gl.minimum(last, last + k0)
        for r in gl.static_range(R0, R0 + NROWS):
            row = gl.load(rows_ptr + (gl.minimum(first, last - r) + r))
            tma.async_copy_global_to_shared(desc, [row, k0], bar, view.slice(r, 1))


def row_desc(src, stage_rows: int):
    """A descriptor of src [T, K] bf16 (row stride src.stride(0), unit column stride) for ``gather_rows``: block
    [1, 64] in the 128-byte-swizzled layout of a [stage_rows, 64] stage."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moetrain.kernels.gluon_descs import shared_layout

    return TensorDescriptor(src, list(src.shape), [src.stride(0), 1], [1, COLUMNS],
                            shared_layout([stage_rows, COLUMNS]))


@gluon.jit
def copy_rows_async(src_ptr, stride, red, rows_ptr, first, last, k0, bar, stage, R0: gl.constexpr,
                    NROWS: gl.constexpr):
    """The same rows of the stage as ``gather_rows``, by cp.async from one warp (16 bytes per thread per copy, through
    the load path instead of the TMA unit), columns past ``red`` zero-filled; completion arrives on ``bar`` once per
    thread (32 arrivals, counted in the barrier's init). The writes are the generic proxy's: the reader fences
    (fence_async_shared) before its wgmma reads the stage."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    r = gl.arange(0, NROWS, layout=gl.SliceLayout(1, layout))
    c = k0 + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    rows = gl.load(rows_ptr + gl.minimum(first + (R0 + r), last)).to(gl.int64)
    ptrs = src_ptr + gl.expand_dims(rows * stride, 1) + gl.expand_dims(c, 0)
    mask = gl.expand_dims(r >= 0, 1) & gl.expand_dims(c < red, 0)
    async_copy.async_copy_global_to_shared(stage.slice(R0, NROWS), ptrs, mask)
    async_copy.mbarrier_arrive(bar, increment_count=False)
