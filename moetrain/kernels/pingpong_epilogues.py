"""SwiGLU epilogues of the ping-pong forward / data gradient (rowgroup_pingpong.py, Gluon, Hopper): what a consumer
warpgroup does with its finished accumulator tile instead of storing it (the kernel's EPILOGUE constexpr).

    swiglu_fwd_epilogue   FC1's tile acc [BM, 2 CN] (gate columns, then up) -> h's two halves and
                          a = act(g, u) * probs[row], by TMA from the consumer's own shared buffers
    swiglu_bwd_epilogue   FC2's data-gradient tile da [BM, TN] -> dh's gate and up columns (and the rows' partial
                          d probs), g and u loaded from h in registers

Legend as in rowgroup_pingpong.py: M routed rows, I expert intermediate, h [M, 2I] (gate columns, then up).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma


@gluon.jit
def swiglu_fwd_epilogue(acc, bufs, ROLE: gl.constexpr, a_desc, h_desc, h_up_desc, probs_ptr, m0, n0, row_end,
                         BM: gl.constexpr, CN: gl.constexpr, ACT: gl.constexpr, HAS_PROBS: gl.constexpr,
                         RAGGED: gl.constexpr):
    """FC1's tile acc [BM, 2 CN] (gate columns n0.. of h, then the up columns I + n0..) -> h's two halves and
    a [:, n0..] = act(g, u) (* probs[row]), from g and u rounded to bf16 as the separate SwiGLU kernel reads them.
    bufs[2 ROLE], bufs[2 ROLE + 1]: this warpgroup's store buffers (g then a, and u), so that 5 stages fit."""
    # A thread of the wgmma layout holds columns c and c + CN of the same rows: the split moves no data.
    g, u = acc.reshape([BM, 2, CN]).permute((0, 2, 1)).split()
    g = g.to(h_desc.dtype)
    u = u.to(h_desc.dtype)
    at = [RAGGED, row_end, RAGGED - row_end + m0, n0]
    tma.store_wait(pendings=0)  # this warpgroup's previous tile has left its store buffers
    bufs.index(2 * ROLE).reshape([BM, CN]).store(g)
    bufs.index(2 * ROLE + 1).reshape([BM, CN]).store(u)
    fence_async_shared()
    tma.async_copy_shared_to_global(h_desc, at, bufs.index(2 * ROLE))
    tma.async_copy_shared_to_global(h_up_desc, at, bufs.index(2 * ROLE + 1))
    act, _, _ = activation_and_slopes(g.to(gl.float32), u.to(gl.float32), ACT)
    if HAS_PROBS:
        rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, act.type.layout))
        act = act * gl.expand_dims(gl.load(probs_ptr + rows, mask=rows < row_end, other=0.0), 1)
    tma.store_wait(pendings=1)  # g's store has read its buffer (u's may still be reading)
    bufs.index(2 * ROLE).reshape([BM, CN]).store(act.to(a_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(a_desc, at, bufs.index(2 * ROLE))


# The activations' math is moetrain.kernels.moe_rows._activation / _activation_bwd (Triton), written again here: a
# Gluon kernel cannot call a Triton jit function. ACT 0: silu(g) * u; 1: the clamped one (alpha 1.702, limit 7).
@gluon.jit
def activation_and_slopes(g, u, ACT: gl.constexpr):
    """(act(g, u), d act / d g, d act / d u) of fp32 tiles, with one sigmoid per element."""
    if ACT == 0:
        s = 1.0 / (1.0 + gl.exp(-g))
        act = g * s * u
        dg = u * s * (1.0 + g * (1.0 - s))
        du = g * s
    else:
        gc = gl.minimum(g, 7.0)
        uc = gl.minimum(gl.maximum(u, -7.0), 7.0)
        s = 1.0 / (1.0 + gl.exp(-1.702 * gc))
        act = gc * s * (uc + 1.0)
        dg = gl.where(g > 7.0, 0.0, (uc + 1.0) * s * (1.0 + 1.702 * gc * (1.0 - s)))
        du = gl.where((u < -7.0) | (u > 7.0), 0.0, gc * s)
    return act, dg, du


@gluon.jit
def _row_halves(t):
    """t [R, C] -> (rows [0, R/2), rows [R/2, R)), in a layout where each thread repeats over the rows (the 16-byte
    row layout of _swiglu_bwd_epilogue), so the split moves no data."""
    R: gl.constexpr = t.type.shape[0]
    C: gl.constexpr = t.type.shape[1]
    return t.reshape([2, R // 2, C]).permute((1, 2, 0)).split()


@gluon.jit
def _swiglu_bwd_rows(da, h_ptr, dh_ptr, probs_ptr, parts_ptr, r0, n0, row_end, I, n_tiles, TN: gl.constexpr,
                     ACT: gl.constexpr, HAS_PROBS: gl.constexpr):
    """SwiGLU's backward on da [R, TN] (bf16, rows r0.., columns n0.. of I): g and u loaded from h [M, 2I] in da's
    layout, dh's gate and up columns stored from it; with probs, the rows' partial d probs into parts [M, n_tiles]."""
    R: gl.constexpr = da.type.shape[0]
    local = gl.arange(0, R, layout=gl.SliceLayout(1, da.type.layout))
    rows = r0 + local
    cols = n0 + gl.arange(0, TN, layout=gl.SliceLayout(0, da.type.layout))
    live_rows = rows < row_end
    live = gl.expand_dims(live_rows, 1) & gl.expand_dims(cols < I, 0)
    h_ptr += r0.to(gl.int64) * (2 * I)  # 32-bit offsets from the first row: fewer registers than 64-bit ones
    dh_ptr += r0.to(gl.int64) * (2 * I)
    at = gl.expand_dims(local * (2 * I), 1) + gl.expand_dims(cols, 0)
    g = gl.load(h_ptr + at, mask=live, other=0.0).to(gl.float32)
    u = gl.load(h_ptr + at + I, mask=live, other=0.0).to(gl.float32)
    da = da.to(gl.float32)
    act, slope_g, slope_u = activation_and_slopes(g, u, ACT)
    if HAS_PROBS:
        gl.store(parts_ptr + rows.to(gl.int64) * n_tiles + n0 // TN, gl.sum(da * act, axis=1), mask=live_rows)
        da = da * gl.expand_dims(gl.load(probs_ptr + rows, mask=live_rows, other=0.0), 1)
    gl.store(dh_ptr + at, (da * slope_g).to(dh_ptr.dtype.element_ty), mask=live)
    gl.store(dh_ptr + at + I, (da * slope_u).to(dh_ptr.dtype.element_ty), mask=live)


@gluon.jit
def swiglu_bwd_epilogue(acc, h_ptr, dh_ptr, probs_ptr, parts_ptr, m0, n0, row_end, I, n_tiles, BM: gl.constexpr,
                         TN: gl.constexpr, ACT: gl.constexpr, HAS_PROBS: gl.constexpr):
    """SwiGLU's backward on a data-gradient tile: acc = da [BM, TN] (FC2's dgrad, columns n0.. of I) ->
    dh[:, n0..] (gate) and dh[:, I + n0..] (up), and with probs the rows' partial d probs of these columns into
    parts [M, n_tiles]. da is rounded to bf16 (as the separate path's da) and converted to a layout of 16-byte rows
    per thread, in which g and u are loaded and dh stored with whole 16-byte accesses, an eighth of the rows at a
    time; no shared buffer of ours, so each consumer's epilogue is its own."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (TN // 8), TN // 8], [4, 1], [1, 0])
    da = gl.convert_layout(acc.to(dh_ptr.dtype.element_ty), layout)
    top, bottom = _row_halves(da)
    _swiglu_bwd_half(top, h_ptr, dh_ptr, probs_ptr, parts_ptr, m0, n0, row_end, I, n_tiles, TN, ACT, HAS_PROBS)
    _swiglu_bwd_half(bottom, h_ptr, dh_ptr, probs_ptr, parts_ptr, m0 + BM // 2, n0, row_end, I, n_tiles, TN, ACT,
                     HAS_PROBS)


@gluon.jit
def _swiglu_bwd_half(da, h_ptr, dh_ptr, probs_ptr, parts_ptr, r0, n0, row_end, I, n_tiles, TN: gl.constexpr,
                     ACT: gl.constexpr, HAS_PROBS: gl.constexpr):
    """_swiglu_bwd_rows on da [R, TN] (rows r0..) in four passes of R / 4 rows (each pass's g, u, pointers and
    temporaries in registers: with two passes per 128-row tile the routing weights' reduction spilled)."""
    E: gl.constexpr = da.type.shape[0] // 4
    top, bottom = _row_halves(da)
    p0, p1 = _row_halves(top)
    p2, p3 = _row_halves(bottom)
    _swiglu_bwd_rows(p0, h_ptr, dh_ptr, probs_ptr, parts_ptr, r0, n0, row_end, I, n_tiles, TN, ACT, HAS_PROBS)
    _swiglu_bwd_rows(p1, h_ptr, dh_ptr, probs_ptr, parts_ptr, r0 + E, n0, row_end, I, n_tiles, TN, ACT, HAS_PROBS)
    _swiglu_bwd_rows(p2, h_ptr, dh_ptr, probs_ptr, parts_ptr, r0 + 2 * E, n0, row_end, I, n_tiles, TN, ACT, HAS_PROBS)
    _swiglu_bwd_rows(p3, h_ptr, dh_ptr, probs_ptr, parts_ptr, r0 + 3 * E, n0, row_end, I, n_tiles, TN, ACT, HAS_PROBS)
