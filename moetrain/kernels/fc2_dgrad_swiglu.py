"""FC2's data gradient with SwiGLU's backward in its epilogue (Triton): the gradient of the activation, da, never
goes to memory (written by the GEMM and read back by the separate SwiGLU backward: 2 x 0.94 GB at Mixtral,
~0.45 ms of its layer).

Legend: M routed rows (sorted by expert), G experts, H hidden (FC2's output: this GEMM's reduction),
I expert intermediate.

    dy     [M, H]      bf16 / fp16 / fp32: gradient of FC2's output rows
    w2     [G, H, I]   same dtype
    offs   [G]         int32 cumulative row ends (grouped_gemm.py's convention)
    h      [M, 2I]     FC1's output (gate columns 0..I-1, up I..2I-1), what SwiGLU's forward read
    probs  [M]         fp32 or None: the per-row factor SwiGLU's forward applied
    da     = dy_g @ w2[g]        (rounded to h's dtype, as the plain data gradient stores it)
    dh     [M, 2I]     = d act(h) / d h . (da * probs)           (rows past offs[-1]: 0)
    dprobs [M]   fp32  = sum_j da[:, j] * act(h)[:, j]           (rows past offs[-1]: 0)

The tiles are the plain data gradient's (grouped_gemm._row_tiles / _tile_at, OUT = I, one accumulator); the
epilogue reads the tile's gate and up columns of h, writes both halves of dh from registers, and each tile's
share of dprobs to a [M, n_tiles] buffer summed afterwards (one writer per element: deterministic, no atomics).
Registers bound it on sm_90a: the epilogue runs in column pieces of ~16 values per thread (``epilogue_pieces``),
and the tile loop is not flattened (the next tile's prefetch on top of the epilogue spilled at 128x256).
The reference is grouped_gemm_dgrad_ref followed by SwiGLU's backward (``fc2_dgrad_swiglu_ref``).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from moetrain.kernels.grouped_gemm import (
    RAGGED_ROWS, _block_g, _check_device, _on_device, _output, _precision, _row_programs, _row_tiles,
    _run_tail_split, _tile_at, _tma_ok, _zero_rows_past_groups, grouped_gemm_dgrad_ref)
from moetrain.kernels.grouped_gemm_tuning import GemmConfig, pick_config, tail_config
from moetrain.kernels.host import cdiv, rows_bucket
from moetrain.kernels.moe_rows import ACTIVATIONS, _activation, _activation_bwd

# The plain data gradient's TMA candidates that compile without register spills for sm_90a with this epilogue
# (tests/kernels/test_grouped_gemm_sm90.py): not the 256-row, 64x256 or 128x128-on-8-warps tiles.
FC2_DGRAD_SWIGLU_CONFIGS = (
    GemmConfig(128, 256, 64, 3, 8, tail_split=True),
    GemmConfig(128, 128, 64, 4, 4, tail_split=True),
    GemmConfig(128, 256, 64, 3, 8),
    GemmConfig(128, 128, 64, 4, 4),
    GemmConfig(64, 128, 64, 4, 4),
    GemmConfig(128, 128, 64, 2, 4, programs_per_sm=2),
)


def fc2_dgrad_swiglu_ref(dy: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, h: torch.Tensor,
                         activation: str = "swiglu", probs: torch.Tensor | None = None):
    """(dh [M, 2I] in h's dtype, dprobs [M] or None) by the plain references."""
    from moetrain.ops.moe_rows import swiglu_bwd_torch, swiglu_torch

    da = grouped_gemm_dgrad_ref(dy, w2, offs).to(h.dtype)
    dprobs = None
    if probs is not None:
        dprobs = (da * swiglu_torch(h, activation)).sum(dim=1, dtype=probs.dtype)
        da = (da * probs.unsqueeze(1)).to(h.dtype)
    return swiglu_bwd_torch(h, da, activation), dprobs


@triton.jit
def _halves(t, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """The column halves [ROWS, WIDTH] of t [ROWS, 2 WIDTH]."""
    return tl.split(tl.permute(tl.reshape(t, [ROWS, 2, WIDTH]), (0, 2, 1)))


@triton.jit
def _swiglu_bwd_cols(da, n_first, rows, row_ok, h_ptr, dh_ptr, probs_ptr, I, ACT: tl.constexpr,
                     HAS_PROBS: tl.constexpr, WIDTH: tl.constexpr):
    """SwiGLU's backward for columns n_first.. (WIDTH of them) of the tile's rows: writes dh's gate and up columns,
    returns each row's share of dprobs (sum over these columns of da * act; zeros without probs)."""
    cols = n_first + tl.arange(0, WIDTH)
    mask = row_ok[:, None] & (cols < I)[None, :]
    h_at = rows[:, None] * (2 * I) + cols[None, :]
    gate = tl.load(h_ptr + h_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + h_at + I, mask=mask, other=0.0).to(tl.float32)
    da = da.to(tl.float32)
    if HAS_PROBS:
        part = tl.sum(tl.where(mask, da * _activation(gate, up, ACT), 0.0), axis=1)
        da = da * tl.load(probs_ptr + rows, mask=row_ok, other=0.0)[:, None]
    else:
        part = tl.sum(da * 0.0, axis=1)  # zeros, one per row: the caller stores no shares without probs
    dg, du = _activation_bwd(gate, up, da, ACT)
    tl.store(dh_ptr + h_at, dg.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + h_at + I, du.to(dh_ptr.dtype.element_ty), mask=mask)
    return part


@triton.jit(do_not_specialize=["M", "G", "NUM_PROGS"])
def _fc2_dgrad_swiglu_kernel(
    a_desc, a_ptr,  # dy [M, H]; a_desc 2-D, block [BLOCK_M, BLOCK_K]
    w_ptr, w_desc,  # w2 [G, H, I]; w_desc 3-D, block [1, BLOCK_K, BLOCK_N]
    h_ptr, dh_ptr, probs_ptr, parts_ptr,  # h, dh [M, 2I]; probs [M] fp32; parts [M, n_tiles] fp32 (HAS_PROBS)
    offs_ptr,  # [G] int32
    M, I, RED, G,
    stride_am, stride_wg, stride_w1,
    NUM_PROGS,
    ACT: tl.constexpr, HAS_PROBS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr, USE_TMA: tl.constexpr, FLATTEN: tl.constexpr, PRECISION: tl.constexpr,
    PART: tl.constexpr, BIG_M: tl.constexpr,
    PIECES: tl.constexpr,  # the epilogue's column pieces: 2, 4 or 8 (register pressure, see below)
):
    pid = tl.program_id(0)
    out_dtype = dh_ptr.dtype.element_ty
    ends, tile_ends, total, n_tiles = _row_tiles(offs_ptr, M, I, G, BLOCK_M, BLOCK_N, BLOCK_G, PART, BIG_M)
    k_tiles = (RED + BLOCK_K - 1) // BLOCK_K
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)

    for tile in tl.range(pid, total, NUM_PROGS, flatten=FLATTEN):
        g, m0, n0, row_end = _tile_at(tile, ends, tile_ends, M, n_tiles, BLOCK_M, BLOCK_N, GROUP_M, PART, BIG_M)
        w_base = w_ptr + g.to(tl.int64) * stride_wg
        row_ok = (m0 + rm) < row_end
        col_ok = (n0 + rn) < I
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            k_ok = (k0 + rk) < RED
            if USE_TMA:
                a = a_desc.load([m0, k0])  # rows past the group's end only feed rows the stores drop
                b = w_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
            else:
                a = tl.load(a_ptr + m0.to(tl.int64) * stride_am + rm[:, None] * stride_am + (k0 + rk)[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_base + (k0 + rk)[:, None] * stride_w1 + (n0 + rn)[None, :],
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)

        # The epilogue in column pieces of at most 64: the accumulator, h's gate and up tiles and their gradients at
        # once spill registers (tests/kernels/test_grouped_gemm_sm90.py); da rounded as the plain data gradient
        # stores it for the separate kernel
        rows = (m0 + rm).to(tl.int64)
        # (column pieces: PIECES, chosen on the host so that a piece is ~16 values per thread)
        HALF: tl.constexpr = BLOCK_N // 2
        Q: tl.constexpr = BLOCK_N // 4
        E8: tl.constexpr = BLOCK_N // 8
        da0, da1 = _halves(acc.to(out_dtype), BLOCK_M, HALF)
        if PIECES == 2:
            part = _swiglu_bwd_cols(da0, n0, rows, row_ok, h_ptr, dh_ptr, probs_ptr, I, ACT, HAS_PROBS, HALF)
            part += _swiglu_bwd_cols(da1, n0 + HALF, rows, row_ok, h_ptr, dh_ptr, probs_ptr, I, ACT, HAS_PROBS, HALF)
        else:
            part = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for piece in tl.static_range(2):
                quarter_a, quarter_b = _halves(da0 if piece == 0 else da1, BLOCK_M, Q)
                for sub in tl.static_range(2):
                    qd = quarter_a if sub == 0 else quarter_b
                    c0 = n0 + piece * HALF + sub * Q
                    if PIECES == 4:
                        part += _swiglu_bwd_cols(qd, c0, rows, row_ok, h_ptr, dh_ptr, probs_ptr, I, ACT, HAS_PROBS, Q)
                    else:
                        e_a, e_b = _halves(qd, BLOCK_M, E8)
                        part += _swiglu_bwd_cols(e_a, c0, rows, row_ok, h_ptr, dh_ptr, probs_ptr, I, ACT, HAS_PROBS, E8)
                        part += _swiglu_bwd_cols(e_b, c0 + E8, rows, row_ok, h_ptr, dh_ptr, probs_ptr, I, ACT,
                                                 HAS_PROBS, E8)
        if HAS_PROBS:
            tl.store(parts_ptr + rows * n_tiles + n0 // BLOCK_N, part, mask=row_ok)

    _zero_rows_past_groups(dh_ptr, ends, M, 2 * I, 2 * I, pid, NUM_PROGS, BLOCK_M, 2 * BLOCK_N, PART)
    if HAS_PROBS:
        _zero_rows_past_groups(parts_ptr, ends, M, n_tiles, n_tiles, pid, NUM_PROGS, BLOCK_M, BLOCK_N, PART)


def tail_of(body: GemmConfig) -> GemmConfig:
    """The tail launch's config of a tail-split body: grouped_gemm's half-height tiles, but never fewer warps than
    the body (64x256 tiles on 4 warps spill registers with this epilogue)."""
    tail = tail_config(body)
    return dataclasses.replace(tail, num_warps=max(tail.num_warps, body.num_warps))


def epilogue_pieces(block_m: int, block_n: int, num_warps: int) -> int:
    """Column pieces of the epilogue: ~16 accumulator values per thread per piece (more spill on sm_90a)."""
    per_thread = block_m * block_n // (32 * num_warps)
    return max(2, min(8, per_thread // 16, block_n // 16))


def fc2_dgrad_swiglu(dy: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, h: torch.Tensor,
                     activation: str = "swiglu", probs: torch.Tensor | None = None, *,
                     config: GemmConfig | None = None, out: torch.Tensor | None = None,
                     num_programs: int | None = None):
    """(dh [M, 2I] in h's dtype, dprobs [M] fp32 or None): FC2's data gradient and SwiGLU's backward in one
    kernel (see the module docstring). ``config`` (a plain data-gradient config) bypasses the autotuner;
    ``out`` (contiguous [M, 2I]) receives dh."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
    if (dy.dim() != 2 or w2.dim() != 3 or dy.shape[1] != w2.shape[1] or offs.shape != (w2.shape[0],)
            or h.shape != (dy.shape[0], 2 * w2.shape[2])):
        raise ValueError(f"fc2_dgrad_swiglu: dy {tuple(dy.shape)}, w2 {tuple(w2.shape)}, offs {tuple(offs.shape)}, "
                         f"h {tuple(h.shape)} must be [M, H], [G, H, I], [G], [M, 2I]")
    if not dy.dtype == w2.dtype == h.dtype:
        raise ValueError(f"fc2_dgrad_swiglu: dtypes differ ({dy.dtype}, {w2.dtype}, {h.dtype})")
    _check_device(dy, w2, offs, h)
    M, RED = dy.shape
    G, _, inter = w2.shape
    if probs is not None:
        if probs.shape != (M,) or probs.dtype != torch.float32:
            raise ValueError(f"fc2_dgrad_swiglu: probs {tuple(probs.shape)} {probs.dtype} must be [M] = [{M}] float32")
        _check_device(dy, probs)
        probs = probs.contiguous()
    dy, w2, h = dy.contiguous(), w2.contiguous(), h.contiguous()
    offs = offs.to(torch.int32).contiguous()
    dh = _output(out, (M, 2 * inter), h)
    if M == 0 or inter == 0:
        return dh, None if probs is None else torch.zeros_like(probs)
    if G == 0 or RED == 0:  # da = 0: so are dh and dprobs
        return dh.zero_(), None if probs is None else torch.zeros_like(probs)
    tma_ok = _tma_ok(dy, w2, h) and M < RAGGED_ROWS
    parts = {}

    def launch(cfg: GemmConfig, part: int, big_m: int, buf):
        use_tma = cfg.use_tma and tma_ok
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor
            a_desc = TensorDescriptor(dy, [M, RED], [RED, 1], [bm, bk])
            w_desc = TensorDescriptor(w2, [G, RED, inter], [RED * inter, inter, 1], [1, bk, bn])
        else:
            a_desc, w_desc = dy, w2
        nprog = _row_programs(dy.device, cfg, M, G, inter, bn, part, num_programs)
        _fc2_dgrad_swiglu_kernel[(nprog,)](
            a_desc, dy, w2, w_desc, h, dh, probs if probs is not None else h, buf if buf is not None else dh, offs,
            M, inter, RED, G, dy.stride(0), w2.stride(0), w2.stride(1), nprog,
            ACT=ACTIVATIONS[activation], HAS_PROBS=probs is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, BLOCK_G=_block_g(G), USE_TMA=use_tma,
            FLATTEN=False, PRECISION=_precision(dy.dtype), PART=part, BIG_M=big_m,
            PIECES=epilogue_pieces(bm, bn, cfg.num_warps), num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def run(cfg: GemmConfig):
        # dprobs shares: one column per column tile of this config (the tail launch's tiles are as wide)
        buf = None
        if probs is not None:
            buf = torch.empty(M, cdiv(inter, cfg.block_n), dtype=torch.float32, device=dy.device)
            parts["buf"] = buf
        _run_tail_split(cfg, lambda c, part, big_m: launch(c, part, big_m, buf), tail_of)

    key = ("fc2_dgrad_swiglu", dy.dtype, dy.device, inter, RED, rows_bucket(M, G), tma_ok, activation,
           probs is not None)
    with _on_device(dy.device):
        run(pick_config(key, FC2_DGRAD_SWIGLU_CONFIGS, config, run))
    return dh, None if probs is None else parts["buf"].sum(dim=1)
