"""Blockwise FP8 (1 x 128 activation tiles, 128 x 128 weight blocks, fp32 scales) in Triton: the activation
quantizer and the grouped GEMM. References: ``moetrain.ops.fp8_quant`` (quantize) and
``moetrain.ops.grouped_gemm_fp8`` (the GEMMs); the recipe is described there.

Shapes and dtypes (legend in ``fp8_quant``):
    quantize_rows_1x128:    x [M, K] float -> (q [M, K] float8_e4m3fn, s [M, ceil(K / 128)] float32)
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

from moetrain.kernels.grouped_gemm_configs import interpreter_numpy_shim, interpreting

BLOCK_K = 128  # the recipe's tile: one scale per 128 values along K
E4M3_MAX = 448.0


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                          BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + pid_k, scale, mask=rows < M)


def quantize_rows_1x128(x: torch.Tensor, block_m: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, s [M, ceil(K / 128)] float32): one pass over x."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, triton.cdiv(K, BLOCK_K), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    x = x if x.stride(1) == 1 else x.contiguous()
    if interpreting():
        interpreter_numpy_shim()
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, BLOCK_K))
    _quantize_rows_kernel[grid](x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0),
                                BLOCK_M=block_m, BLOCK=BLOCK_K, FP8_MAX=E4M3_MAX)
    return q, s


@triton.jit
def _grouped_blockwise_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, y_ptr, offs_ptr, M, N, K, G,
                              stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn,
                              stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_G: tl.constexpr):
    # Row tiles of every group, from offs: tile t of the launch belongs to the group whose cumulative tile count
    # first exceeds t. Programs past the last tile exit.
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    gi = tl.arange(0, BLOCK_G)
    ends = tl.minimum(tl.load(offs_ptr + tl.minimum(gi, G - 1)), M)
    starts = tl.load(offs_ptr + tl.maximum(tl.minimum(gi - 1, G - 1), 0), mask=gi > 0, other=0)
    starts = tl.minimum(starts, M)
    tiles = tl.where(gi < G, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0)
    tile_ends = tl.cumsum(tiles, 0)
    if pid >= tl.max(tile_ends, 0):
        return
    g = tl.sum((tile_ends <= pid).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(gi == g, tile_ends - tiles, 0), 0)
    row_start = tl.sum(tl.where(gi == g, starts, 0), 0)
    row_end = tl.sum(tl.where(gi == g, ends, 0), 0)

    rows = row_start + (pid - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < row_end, cols < N
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + g.to(tl.int64) * stride_bg + cols[:, None].to(tl.int64) * stride_bn
    sa_rows = sa_ptr + rows.to(tl.int64) * stride_sam
    sb_block = sb_ptr + g.to(tl.int64) * stride_sbg + (pid_n * BLOCK_N // 128) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    for kb in range(k_tiles):
        k = kb * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_rows + kb, mask=row_ok, other=0.0)
        sb = tl.load(sb_block + kb)
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.float32) * (sa[:, None] * sb)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], y,
             mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm_blockwise(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor,
                           out_dtype: torch.dtype = torch.bfloat16, block_m: int = 128, block_n: int = 128,
                           num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """y [M, N] = the blockwise FP8 grouped GEMM (see the module doc); ``block_n`` must divide 128 (one weight
    block's scale per column tile)."""
    M, K = a.shape
    G, N, _ = b.shape
    if b.shape[2] != K or 128 % block_n:
        raise ValueError(f"grouped_gemm_blockwise: a {tuple(a.shape)}, b {tuple(b.shape)}, block_n {block_n}")
    y = torch.zeros(M, N, dtype=out_dtype, device=a.device)  # rows of no group stay 0
    if M == 0 or N == 0 or G == 0:
        return y
    if interpreting():
        interpreter_numpy_shim()
    max_tiles = triton.cdiv(M, block_m) + G  # each group adds at most one partial tile
    grid = (max_tiles, triton.cdiv(N, block_n))
    _grouped_blockwise_kernel[grid](
        a, sa, b, sb, y, offs, M, N, K, G, a.stride(0), sa.stride(0), b.stride(0), b.stride(1), sb.stride(0),
        sb.stride(1), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        BLOCK_G=triton.next_power_of_2(G), num_warps=num_warps, num_stages=num_stages)
    return y
