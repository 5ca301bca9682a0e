"""Row kernels of the MoE expert path (Triton). Their references, plain PyTorch, are the "torch"
implementations in moetrain.ops.moe_rows (triton-free, so the torch backend needs no triton).

Legend: T tokens, K top-k, M = T*K routed rows (sorted by expert), H hidden, I expert intermediate.
``inverse [M]`` int64 maps flat assignment a = t*K + k to the permuted row that holds it.

    combine      out [T, H]   = sum_k weight[t, k] * y[inverse[t*K + k]]          (weight [T, K] fp32
                                or None for a plain sum: the data gradient of the token gather)
    combine_bwd  dy  [M', H]  : dy[inverse[a]] = weight[a] * dout[a // K]          (M' >= M: rows no
                                assignment reads, e.g. padding, are zero)
                 dweight [T, K] fp32: <dout[t], y[inverse[t*K + k]]>
    swiglu_fwd   a  [M, I]    = act(h[:, :I], h[:, I:]) (* probs[:, None])        h [M, 2I], probs [M] fp32
    swiglu_bwd   dh [M, 2I]   and dprobs [M] fp32 from h, da [M, I] (and probs)

Every kernel accumulates in fp32 and writes the dtype of its 16/32-bit input. Each token (or
row) is owned by one program, so the top-k reduction needs no atomics and is deterministic; grids
depend on shapes only (no host reads of routing: sync-free and CUDA-graph capturable).
Activations: "swiglu" = silu(g) * u; "swiglu_clamped" (GPT-OSS) = g' * sigmoid(1.702 g') * (u' + 1)
with g' = min(g, 7), u' = clamp(u, -7, 7).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moetrain.kernels.host import cdiv, next_pow2, require_pow2

from moetrain.kernels.grouped_gemm import _check_device, _on_device
from moetrain.kernels.launch import launch
from moetrain.ops import moe_rows as _ops

ACTIVATIONS = {"swiglu": 0, "swiglu_clamped": 1}

# The references (one implementation: the ops' PyTorch path, which must not need triton).
combine_ref = _ops.combine_torch
combine_bwd_ref = _ops.combine_bwd_torch
swiglu_ref = _ops.swiglu_torch
swiglu_bwd_ref = _ops.swiglu_bwd_torch

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(y_ptr, inverse_ptr, weight_ptr, out_ptr, H, TOPK: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        row = tl.load(inverse_ptr + t * TOPK + k).to(tl.int64)
        v = tl.load(y_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            v = v * tl.load(weight_ptr + t * TOPK + k)
        acc += v
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, inverse_ptr, weight_ptr, dy_ptr, dweight_ptr, H,
                        TOPK: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_H: tl.constexpr):
    # Without a weight, program (t, j) copies columns j*BLOCK_H.. of dout[t] to its K rows (a 2-D grid like
    # the combine's); with one, program t walks all of H, since dweight[t, k] reduces over it.
    t = tl.program_id(0).to(tl.int64)
    if HAS_WEIGHT:
        for k in tl.static_range(TOPK):
            row = tl.load(inverse_ptr + t * TOPK + k).to(tl.int64)
            scale = tl.load(weight_ptr + t * TOPK + k)
            dot = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):  # dout[t] is re-read per k from L1/L2, not HBM
                cols = h0 + tl.arange(0, BLOCK_H)
                mask = cols < H
                g = tl.load(dout_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(dy_ptr + row * H + cols, (g * scale).to(dy_ptr.dtype.element_ty), mask=mask)
                dot += g * tl.load(y_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dweight_ptr + t * TOPK + k, tl.sum(dot, axis=0))
    else:  # one load of dout[t]'s columns, K stores (the stores may alias dout for all the compiler knows)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        g = tl.load(dout_ptr + t * H + cols, mask=mask, other=0.0).to(dy_ptr.dtype.element_ty)
        for k in tl.static_range(TOPK):
            row = tl.load(inverse_ptr + t * TOPK + k).to(tl.int64)
            tl.store(dy_ptr + row * H + cols, g, mask=mask)


# The clamped activation's constants (1.702, 7.0) are moetrain.ops.moe_rows' CLAMPED_ALPHA / CLAMPED_LIMIT.
@triton.jit
def _activation(g, u, ACT: tl.constexpr):
    if ACT == 0:
        out = g * tl.sigmoid(g) * u
    else:
        gc = tl.minimum(g, 7.0)
        uc = tl.minimum(tl.maximum(u, -7.0), 7.0)
        out = gc * tl.sigmoid(1.702 * gc) * (uc + 1.0)
    return out


@triton.jit
def _activation_bwd(g, u, da, ACT: tl.constexpr):
    """(d gate, d up) of _activation(g, u) given its gradient da (fp32 tiles)."""
    if ACT == 0:
        s = tl.sigmoid(g)
        dg = da * u * s * (1.0 + g * (1.0 - s))
        du = da * g * s
    else:
        gc = tl.minimum(g, 7.0)
        uc = tl.minimum(tl.maximum(u, -7.0), 7.0)
        s = tl.sigmoid(1.702 * gc)
        dg = tl.where(g > 7.0, 0.0, da * (uc + 1.0) * s * (1.0 + 1.702 * gc * (1.0 - s)))
        du = tl.where((u < -7.0) | (u > 7.0), 0.0, da * gc * s)
    return dg, du


@triton.jit
def _swiglu_tile(h_ptr, M, I, col_block, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """Offsets into [M, I] and the gate/up values (fp32) of this program's [BLOCK_R, BLOCK_I] tile at column block
    ``col_block`` (a block past I is all masked)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = col_block * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows[:, None] < M) & (cols[None, :] < I)
    gate_at = rows[:, None] * 2 * I + cols[None, :]
    g = tl.load(h_ptr + gate_at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + gate_at + I, mask=mask, other=0.0).to(tl.float32)
    return rows[:, None] * I + cols[None, :], gate_at, mask, g, u


@triton.jit
def _row_probs(probs_ptr, M, BLOCK_R: tl.constexpr):
    """[BLOCK_R, 1] fp32 probabilities of this program's rows."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    return tl.load(probs_ptr + rows, mask=rows < M, other=0.0)[:, None]


@triton.jit
def _swiglu_fwd_kernel(h_ptr, probs_ptr, a_ptr, M, I, ACT: tl.constexpr, HAS_PROBS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, COL_STEPS: tl.constexpr):
    if HAS_PROBS:  # one load per program: every column step scales the same rows
        probs = _row_probs(probs_ptr, M, BLOCK_R)
    for step in range(COL_STEPS):
        at, _, mask, g, u = _swiglu_tile(h_ptr, M, I, tl.program_id(1) * COL_STEPS + step, BLOCK_R, BLOCK_I)
        a = _activation(g, u, ACT)
        if HAS_PROBS:
            a = a * probs
        tl.store(a_ptr + at, a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, probs_ptr, da_ptr, dh_ptr, dprobs_part_ptr, M, I, ACT: tl.constexpr,
                       HAS_PROBS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
                       COL_STEPS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    part = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_PROBS:  # one load per program, as in the forward
        probs = _row_probs(probs_ptr, M, BLOCK_R)
    for step in range(COL_STEPS):
        at, gate_at, mask, g, u = _swiglu_tile(h_ptr, M, I, tl.program_id(1) * COL_STEPS + step, BLOCK_R, BLOCK_I)
        da = tl.load(da_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if HAS_PROBS:
            # d probs[r] = sum_i da[r, i] * act[r, i]: this program's columns' share (one partial per row and
            # program column; the launcher sums them when there are several: deterministic, no atomics)
            part += tl.sum(tl.where(mask, da * _activation(g, u, ACT), 0.0), axis=1)
            da = da * probs
        dg, du = _activation_bwd(g, u, da, ACT)
        tl.store(dh_ptr + gate_at, dg.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + gate_at + I, du.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(dprobs_part_ptr + rows.to(tl.int64) * tl.num_programs(1) + tl.program_id(1), part, mask=rows < M)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_BLOCK = 1024


@dataclass(frozen=True)
class RowTile:
    """A row kernel's program: ``rows`` rows (1 for the combines: a program per token) by ``cols`` columns at a time,
    ``steps`` column blocks walked per program (SwiGLU: steps covering all of I leave one program per row block, and
    the backward's d probs needs no second pass), ``warps`` warps. Powers of two, except steps."""
    rows: int
    cols: int
    warps: int = 4
    steps: int = 1

    def __post_init__(self):
        for name in ("rows", "cols", "warps"):
            require_pow2(f"RowTile.{name}", getattr(self, name))
        if self.steps < 1:
            raise ValueError(f"RowTile.steps={self.steps} must be >= 1")


def _block(n: int) -> int:
    return min(_BLOCK, next_pow2(max(n, 16)))


def combine_tile(hidden: int) -> RowTile:
    """The combines' program: one token, all of H in one program up to 4096 columns, 8 warps from 4096 columns.
    `moetrain bench rows` on the H200 (bench/row_kernels.md): GPT-OSS's H = 2880 in one 4096-wide
    program, 1.03-1.04x the earlier 1024-wide ones (three per token, the last mostly masked); Mixtral 1.01-1.02x;
    Qwen3 1.00-1.03x."""
    cols = min(4096, next_pow2(max(hidden, 16)))
    return RowTile(1, cols, 8 if cols >= 4096 else 4)


def _token_tile(tile: RowTile | None, hidden: int) -> RowTile:
    tile = tile or combine_tile(hidden)
    if tile.rows != 1 or tile.steps != 1:
        raise ValueError(f"combine: {tile} must have rows=1 and steps=1 (a program per token and column block)")
    return tile


def _check_combine(inverse: torch.Tensor, weight: torch.Tensor | None, tokens: int, like: torch.Tensor) -> int:
    if inverse.dim() != 1 or tokens < 1 or inverse.shape[0] % tokens:
        raise ValueError(f"combine: inverse {tuple(inverse.shape)} must be [M] with M a multiple of T={tokens}")
    topk = inverse.shape[0] // tokens
    if weight is not None and (weight.shape != (tokens, topk) or weight.dtype != torch.float32):
        raise ValueError(f"combine: weight {tuple(weight.shape)} {weight.dtype} must be [T, K] = "
                         f"[{tokens}, {topk}] float32")
    _check_device(like, inverse, *([] if weight is None else [weight]))
    return topk


def combine(y: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor | None, topk: int,
            tile: RowTile | None = None) -> torch.Tensor:
    """out [T, H] = sum_k weight[t, k] * y[inverse[t*K + k]] (weight None: 1); y [M', H] with M' >= M =
    T*K rows (rows no assignment reads are ignored) -> y's dtype. tile: the program (``combine_tile`` by default)."""
    if y.dim() != 2 or topk < 1 or inverse.dim() != 1 or inverse.shape[0] % topk or y.shape[0] < inverse.shape[0]:
        raise ValueError(f"combine: y {tuple(y.shape)} must be [M', H] and inverse {tuple(inverse.shape)} [M], "
                         f"M a multiple of topk={topk} and M' >= M")
    tokens = inverse.shape[0] // topk
    if tokens == 0 or y.shape[1] == 0:
        return y.new_zeros(tokens, y.shape[1])
    _check_combine(inverse, weight, tokens, y)
    y, inverse = y.contiguous(), inverse.contiguous()
    H = y.shape[1]
    tile = _token_tile(tile, H)
    out = torch.empty(tokens, H, dtype=y.dtype, device=y.device)
    with _on_device(y.device):
        launch(_combine_kernel, (tokens, cdiv(H, tile.cols)),
            y, inverse, weight if weight is not None else y, out, H, TOPK=topk,
            HAS_WEIGHT=weight is not None, BLOCK_H=tile.cols, num_warps=tile.warps)
    return out


def combine_bwd(dout: torch.Tensor, y: torch.Tensor | None, inverse: torch.Tensor, weight: torch.Tensor | None,
                rows: int | None = None, tile: RowTile | None = None):
    """Gradients of ``combine`` from dout [T, H]: (dy [rows, H] in dout's dtype, rows default M, rows past
    what the assignments read zero; dweight [T, K] fp32, or None when weight is None; y is read only with
    a weight). tile: the program (``combine_tile`` by default; with a weight a program walks all of H)."""
    tokens, H = dout.shape
    M = inverse.shape[0]
    rows = M if rows is None else rows
    if rows < M:
        raise ValueError(f"combine_bwd: rows={rows} must be >= M={M}")
    alloc = torch.zeros if rows > M else torch.empty
    if tokens == 0 or H == 0:
        dweight = None if weight is None else torch.zeros_like(weight)
        return torch.zeros(rows, H, dtype=dout.dtype, device=dout.device), dweight
    topk = _check_combine(inverse, weight, tokens, dout)
    if weight is not None and (y is None or y.shape[1] != H or y.shape[0] < M):
        raise ValueError(f"combine_bwd: y must be [M', {H}] with M' >= {M} when weight is given")
    tile = _token_tile(tile, H)
    dout, inverse = dout.contiguous(), inverse.contiguous()
    y = dout if y is None else y.contiguous()  # an unused pointer without a weight
    dy = alloc(rows, H, dtype=dout.dtype, device=dout.device)
    dweight = None if weight is None else torch.empty(tokens, topk, dtype=torch.float32, device=dout.device)
    with _on_device(dout.device):
        grid = (tokens,) if weight is not None else (tokens, cdiv(H, tile.cols))
        launch(_combine_bwd_kernel, grid,
            dout, y, inverse, weight if weight is not None else dout, dy, dweight if weight is not None else dout, H,
            TOPK=topk, HAS_WEIGHT=weight is not None, BLOCK_H=tile.cols, num_warps=tile.warps)
    return dy, dweight


def token_rows(x: torch.Tensor, inverse: torch.Tensor, tile: RowTile | None = None) -> torch.Tensor:
    """x_perm [M, H] = x[token_of_row] (the token rows in expert order), written token by token: x [T, H], inverse
    [M] int64 (kernels.sort_rows') with M = T*K -> x_perm[inverse[t*K + k]] = x[t]. Each token's row is read from HBM
    once; a gather by row (x.index_select(0, token_of_row)) reads it K times whenever a token's K rows run far apart
    in time, as with random or skewed routing (Qwen3, skewed: 0.27 against 0.18 ms per gather, bench/method.md).
    combine's backward without weights is this very copy."""
    return combine_bwd(x, None, inverse, None, tile=tile)[0]


def swiglu_tile(inter: int) -> RowTile:
    """The SwiGLU kernels' program: [2048 / w, w] steps over all of I (one program per row block: the backward's
    d probs in one pass) on 8 warps. Columns w: of 1024, 512 and 256 the width that leaves the fewest masked lanes
    past I (the widest on a tie): Qwen3's I = 768 takes 256, where 1024 left a quarter of every program's lanes idle.
    `moetrain bench rows` on the H200 (bench/row_kernels.md), against one [4096 / w, w] step per program on
    4 warps: the backward 1.06x at Qwen3 (8 x 256, 3 steps: 0.239 ms, 4.2 TB/s), 1.21x at GPT-OSS (2 x 1024, 3 steps);
    the forward 1.02-1.09x."""
    if inter <= 256:
        block = _block(inter)
    else:
        block = min((1024, 512, 256), key=lambda width: (cdiv(inter, width) * width - inter, -width))
    return RowTile(max(1, 2048 // block), block, 8, cdiv(inter, block))


def _check_swiglu(h: torch.Tensor, activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu: h {tuple(h.shape)} must be [M, 2I]")
    return h.shape[1] // 2


def _check_probs(probs: torch.Tensor | None, rows: int, like: torch.Tensor) -> None:
    if probs is not None:
        if probs.shape != (rows,) or probs.dtype != torch.float32:
            raise ValueError(f"swiglu: probs {tuple(probs.shape)} {probs.dtype} must be [M] = [{rows}] float32")
        _check_device(like, probs)


def _swiglu_grid(rows: int, inter: int, tile: RowTile) -> tuple[int, int]:
    """(row blocks, programs per row block): the column blocks of I split into runs of tile.steps."""
    return cdiv(rows, tile.rows), cdiv(cdiv(inter, tile.cols), tile.steps)


def swiglu_fwd(h: torch.Tensor, activation: str = "swiglu", probs: torch.Tensor | None = None,
               tile: RowTile | None = None) -> torch.Tensor:
    """a [M, I] = act(h[:, :I], h[:, I:]) (* probs[:, None] when given) for h [M, 2I]; dtype of h.
    probs [M] fp32: a per-row factor (e.g. the routing weight, applied before FC2 instead of after it).
    tile: the program (``swiglu_tile`` by default)."""
    inter = _check_swiglu(h, activation)
    _check_device(h)
    _check_probs(probs, h.shape[0], h)
    h = h.contiguous()
    a = torch.empty(h.shape[0], inter, dtype=h.dtype, device=h.device)
    if a.numel() == 0:
        return a
    tile = tile or swiglu_tile(inter)
    with _on_device(h.device):
        launch(_swiglu_fwd_kernel, _swiglu_grid(h.shape[0], inter, tile),
            h, probs if probs is not None else h, a, h.shape[0], inter, ACT=ACTIVATIONS[activation],
            HAS_PROBS=probs is not None, BLOCK_R=tile.rows, BLOCK_I=tile.cols, COL_STEPS=tile.steps,
            num_warps=tile.warps)
    return a


def swiglu_bwd(h: torch.Tensor, da: torch.Tensor, activation: str = "swiglu", probs: torch.Tensor | None = None,
               tile: RowTile | None = None):
    """Gradients of ``swiglu_fwd`` from da [M, I]: (dh [M, 2I] in h's dtype, dprobs [M] fp32 or None).
    tile: the program (``swiglu_tile`` by default); d probs is summed over a row's programs by a second (PyTorch)
    pass only when the tile's steps leave more than one program per row block."""
    inter = _check_swiglu(h, activation)
    if da.shape != (h.shape[0], inter):
        raise ValueError(f"swiglu_bwd: da {tuple(da.shape)} must be [M, I] = [{h.shape[0]}, {inter}]")
    _check_device(h, da)
    _check_probs(probs, h.shape[0], h)
    h, da = h.contiguous(), da.contiguous()
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if dh.numel() == 0:
        return dh, None if probs is None else torch.zeros_like(probs)
    tile = tile or swiglu_tile(inter)
    grid = _swiglu_grid(h.shape[0], inter, tile)
    parts = torch.empty(h.shape[0], grid[1], dtype=torch.float32, device=h.device) if probs is not None else None
    with _on_device(h.device):
        launch(_swiglu_bwd_kernel, grid,
            h, probs if probs is not None else h, da, dh, parts if parts is not None else dh, h.shape[0], inter,
            ACT=ACTIVATIONS[activation], HAS_PROBS=probs is not None, BLOCK_R=tile.rows, BLOCK_I=tile.cols,
            COL_STEPS=tile.steps, num_warps=tile.warps)
    if parts is None:
        return dh, None
    return dh, parts.view(-1) if grid[1] == 1 else parts.sum(dim=1)
