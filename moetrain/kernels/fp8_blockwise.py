"""Blockwise FP8 (1 x 128 activation tiles, 128 x 128 weight blocks, fp32 scales) grouped GEMM in Triton; its
operands come from ``fp8_quantize``. Reference: ``moetrain.ops.grouped_gemm_fp8``; the recipe: ``ops.fp8_quant``.

Shapes and dtypes (legend in ``fp8_quant``):
    grouped_gemm_blockwise: a [M, K] fp8, sa [M, ceil(K / 128)]; b [G, N, K] fp8, sb [G, ceil(N / 128),
                            ceil(K / 128)]; offs [G] int32 cumulative row ends -> y [M, N] out_dtype
                            (y_g = dequant(a_g) @ dequant(b_g)^T; rows past offs[-1] are 0)

The GEMM accumulates each 128-wide K slice's FP8 product in fp32 and adds it scaled by that slice's row scales x
block scale (DeepSeek-V3's promotion of partial sums), so the result equals the reference's fp32 math on the
quantized values up to summation order. Both operands are K-major, as Hopper's FP8 tensor cores need: the data
gradient runs the same kernel on the gradient (quantized along N) and a transposed FP8 copy of the weight (the
same 128 x 128 blocks). The row tiles of each group are found on the device from offs: no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.launch import launch
from moetrain.kernels.grouped_gemm_configs import interpreter_numpy_shim, interpreting

BLOCK_K = 128  # the recipe's tile: one scale per 128 values along K


@triton.jit
def _band_row_tile(offs_ptr, M, N, G, ROW_TILES, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile of a grouped GEMM over row groups (offs_ptr: G int32 cumulative row ends): (live, group g,
    rows [BLOCK_M], the group's row end, column tile). Launch order: bands of GROUP_M row tiles sweep the column
    tiles, so the programs running together share a few row tiles of a and a group's weight tiles (a
    column-tile-major order re-reads all of a per column tile). Row tile t belongs to the group whose cumulative
    tile count first exceeds t; tiles past the last are not live."""
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(N, BLOCK_N)
    first = (pid // (GROUP_M * col_tiles)) * GROUP_M
    band_rows = tl.minimum(ROW_TILES - first, GROUP_M)
    tile = first + (pid % (GROUP_M * col_tiles)) % band_rows
    pid_n = (pid % (GROUP_M * col_tiles)) // band_rows
    gi = tl.arange(0, BLOCK_G)
    ends = tl.minimum(tl.load(offs_ptr + tl.minimum(gi, G - 1)), M)
    starts = tl.load(offs_ptr + tl.maximum(tl.minimum(gi - 1, G - 1), 0), mask=gi > 0, other=0)
    starts = tl.minimum(starts, M)
    tiles = tl.where(gi < G, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0)
    tile_ends = tl.cumsum(tiles, 0)
    live = tile < tl.max(tile_ends, 0)
    g = tl.sum((tile_ends <= tile).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(gi == g, tile_ends - tiles, 0), 0)
    row_start = tl.sum(tl.where(gi == g, starts, 0), 0)
    row_end = tl.sum(tl.where(gi == g, ends, 0), 0)
    rows = row_start + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    return live, g, rows, row_end, pid_n


@triton.jit
def _grouped_blockwise_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, y_ptr, offs_ptr, M, N, K, G, ROW_TILES,
                              stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn,
                              stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr, PAIR: tl.constexpr):
    live, g, rows, row_end, pid_n = _band_row_tile(offs_ptr, M, N, G, ROW_TILES, BLOCK_M, BLOCK_N, BLOCK_G, GROUP_M)
    if not live:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < row_end, cols < N
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + g.to(tl.int64) * stride_bg + cols[:, None].to(tl.int64) * stride_bn
    sa_rows = sa_ptr + rows.to(tl.int64) * stride_sam
    sb_cols = sb_ptr + g.to(tl.int64) * stride_sbg + (cols // 128) * stride_sbn  # each column's weight block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    for kb in range(0, k_tiles, 1 + PAIR):
        k = kb * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_rows + kb, mask=row_ok, other=0.0)
        sb = tl.load(sb_cols + kb, mask=col_ok, other=0.0)
        part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        if PAIR:  # a second K slice issued before the first is scaled: its product overlaps the promotion
            k2 = k + BLOCK_K
            k2_ok = k2 < K
            a2 = tl.load(a_rows + k2[None, :], mask=row_ok[:, None] & k2_ok[None, :], other=0.0)
            b2 = tl.load(b_rows + k2[None, :], mask=col_ok[:, None] & k2_ok[None, :], other=0.0)
            more = kb + 1 < k_tiles
            sa2 = tl.load(sa_rows + kb + 1, mask=row_ok & more, other=0.0)
            sb2 = tl.load(sb_cols + kb + 1, mask=col_ok & more, other=0.0)
            part2 = tl.dot(a2, tl.trans(b2), out_dtype=tl.float32)
            acc += part * (sa[:, None] * sb[None, :]) + part2 * (sa2[:, None] * sb2[None, :])
        else:
            acc += part * (sa[:, None] * sb[None, :])
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], y,
             mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm_blockwise(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor,
                           out_dtype: torch.dtype = torch.bfloat16, block_m: int = 128, block_n: int = 128,
                           num_warps: int = 8, num_stages: int = 3, group_m: int = 8, pair: bool = False
                           ) -> torch.Tensor:
    """y [M, N] = the blockwise FP8 grouped GEMM (see the module doc). Tile (block_m, block_n), launch bands of
    group_m row tiles; ``pair``: two K slices per iteration."""
    M, K = a.shape
    G, N, _ = b.shape
    if b.shape[2] != K:
        raise ValueError(f"grouped_gemm_blockwise: a {tuple(a.shape)} and b {tuple(b.shape)} do not match")
    y = torch.zeros(M, N, dtype=out_dtype, device=a.device)  # rows of no group stay 0
    if M == 0 or N == 0 or G == 0:
        return y
    if interpreting():
        interpreter_numpy_shim()
    row_tiles = triton.cdiv(M, block_m) + G  # each group adds at most one partial tile
    grid = (row_tiles * triton.cdiv(N, block_n),)
    launch(_grouped_blockwise_kernel, grid, a, sa, b, sb, y, offs, M, N, K, G, row_tiles, a.stride(0), sa.stride(0),
           b.stride(0), b.stride(1), sb.stride(0), sb.stride(1), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
           BLOCK_K=BLOCK_K, BLOCK_G=triton.next_power_of_2(G), GROUP_M=group_m, PAIR=int(pair), num_warps=num_warps,
           num_stages=num_stages)
    return y


@triton.jit
def _grouped_wgrad_blockwise_kernel(at_ptr, sat_ptr, bt_ptr, sbt_ptr, dw_ptr, offs_ptr, M, N, K,
                                    stride_atn, stride_satn, stride_btk, stride_sbtk, stride_dwg, stride_dwn,
                                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_n, pid_k, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    end = tl.minimum(tl.load(offs_ptr + g), M)
    start = tl.minimum(tl.load(offs_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0), end)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok, k_ok = n < N, k < K
    a_rows = at_ptr + n[:, None].to(tl.int64) * stride_atn
    b_rows = bt_ptr + k[:, None].to(tl.int64) * stride_btk
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # the 128-row tiles of the quantization that meet the group; partial ones are masked to its rows
    for t in range(start // BLOCK_R, (end + BLOCK_R - 1) // BLOCK_R):
        r = t * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = (r >= start) & (r < end)
        a = tl.load(a_rows + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_rows + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        sa = tl.load(sat_ptr + n.to(tl.int64) * stride_satn + t, mask=n_ok, other=0.0)
        sb = tl.load(sbt_ptr + k.to(tl.int64) * stride_sbtk + t, mask=k_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * (sa[:, None] * sb[None, :])
    dw = acc.to(dw_ptr.dtype.element_ty)
    tl.store(dw_ptr + g.to(tl.int64) * stride_dwg + n[:, None].to(tl.int64) * stride_dwn + k[None, :], dw,
             mask=n_ok[:, None] & k_ok[None, :])


def grouped_wgrad_blockwise(at: torch.Tensor, sat: torch.Tensor, bt: torch.Tensor, sbt: torch.Tensor,
                            offs: torch.Tensor, out_dtype: torch.dtype = torch.float32, block_n: int = 128,
                            block_k: int = 128, num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """dw [G, N, K] = the blockwise FP8 weight gradient: dw_g = dequant(at[:, rows of g]) @ dequant(bt[:, rows of
    g])^T, with at = dy^T [N, M] and bt = x^T [K, M] quantized along M in tiles of 128 rows
    (``fp8_quantize.quantize_rows_and_cols``), sat [N, ceil(M / 128)], sbt [K, ceil(M / 128)]. An empty group's
    gradient is 0."""
    N, M = at.shape
    K = bt.shape[0]
    G = offs.shape[0]
    if bt.shape[1] != M:
        raise ValueError(f"grouped_wgrad_blockwise: at {tuple(at.shape)} and bt {tuple(bt.shape)} do not match")
    dw = torch.empty(G, N, K, dtype=out_dtype, device=at.device)
    if G == 0 or N == 0 or K == 0:
        return dw
    if interpreting():
        interpreter_numpy_shim()
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k), G)
    launch(_grouped_wgrad_blockwise_kernel, grid, at, sat, bt, sbt, dw, offs, M, N, K, at.stride(0), sat.stride(0),
                                          bt.stride(0), sbt.stride(0), dw.stride(0), dw.stride(1),
                                          BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=BLOCK_K, num_warps=num_warps,
                                          num_stages=num_stages)
    return dw
