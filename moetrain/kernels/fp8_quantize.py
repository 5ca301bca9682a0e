"""FP8 quantization kernels of the blockwise recipe (1 x 128 activation tiles, 128 x 128 weight blocks, fp32
scales; reference: ``moetrain.ops.fp8_quant``, whose rule each reproduces bit for bit: one IEEE division, ``div_rn``, per
scale and its inverse (the GPU's default division is approximate), the elements multiplied by the inverse): one pass over the
input writes the data and the scales, and the activations' transposed copies the backward needs in the same pass.

Shapes and dtypes (legend in ``ops.fp8_quant``):
    quantize_rows_1x128:      x [M, C] float -> (q [M, C] float8_e4m3fn, s [M, ceil(C / 128)] float32)
    quantize_rows_and_cols:   x [M, C] float -> the above, and (qt [C, M] float8_e4m3fn, st [C, ceil(M / 128)] float32):
                              x^T quantized along M in tiles of 128 rows of x, the weight gradient's operand. Its
                              tiles respect group boundaries when every group starts on a multiple of 128 rows
                              (``ops.permute(align=128)``).
    quantize_weight_blocks:   w [G, N, K] float -> (q [G, N, K], qt [G, K, N] float8_e4m3fn, s [G, ceil(N / 128),
                              ceil(K / 128)] float32): the blocks and their transpose (the data gradient's operand,
                              same scales transposed; a copy of q).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.launch import launch
from moetrain.kernels.grouped_gemm_configs import interpreter_rounding_shim, interpreter_numpy_shim, interpreting

BLOCK = 128
CHUNK = 16  # rows of a tile in registers at a time
E4M3_MAX = 448.0


def _prepare() -> None:
    if interpreting():
        interpreter_numpy_shim()
        interpreter_rounding_shim()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                          BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.div_rn(amax, FP8_MAX), 1.0)
    inverse = tl.where(amax > 0, tl.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax), 1.0)
    q = tl.clamp(x * inverse[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + pid_k, scale, mask=rows < M)


def quantize_rows_1x128(x: torch.Tensor, block_m: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, s [M, ceil(K / 128)] float32): one pass over x."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, triton.cdiv(K, BLOCK), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    x = x if x.stride(1) == 1 else x.contiguous()
    _prepare()
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, BLOCK))
    launch(_quantize_rows_kernel, grid, x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0),
                                BLOCK_M=block_m, BLOCK=BLOCK, FP8_MAX=E4M3_MAX)
    return q, s


@triton.jit
def _scale_and_inverse(amax, FP8_MAX: tl.constexpr):
    """(amax / 448, 448 / amax) by IEEE divisions; (1, 1) where amax is 0."""
    scale = tl.where(amax > 0, tl.div_rn(amax, FP8_MAX), 1.0)
    inverse = tl.where(amax > 0, tl.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax), 1.0)
    return scale, inverse


@triton.jit
def _load_chunk(x_tile, r0, row0, R, cols, c_ok, stride_xr, CHUNK: tl.constexpr):
    """Rows r0 .. r0 + CHUNK of a tile starting at global row row0 (x_tile points there), fp32, zero past R and C;
    with the rows, their validity and the chunk's mask."""
    rows = row0 + r0 + tl.arange(0, CHUNK)
    r_ok = rows < R
    mask = r_ok[:, None] & c_ok[None, :]
    x = tl.load(x_tile + (r0 + tl.arange(0, CHUNK))[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32), rows, r_ok, mask


@triton.jit
def _quantize_tile_2d_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, C, stride_xb, stride_xr, stride_qb, stride_qr,
                             stride_sb, stride_sr, stride_qtb, stride_qtc, stride_stb, stride_stc,
                             BLOCK: tl.constexpr, CHUNK: tl.constexpr, FP8_MAX: tl.constexpr, SQUARE: tl.constexpr):
    """One 128 x 128 tile of x[b] [R, C], in chunks of CHUNK rows (a whole tile's pointers in registers spill).
    SQUARE: one scale for the tile (weight blocks) -> q, s [.., R/128, C/128] (qt unused). Else: per row over the tile's columns -> q, s [.., R, C/128]; per column over its rows -> qt [.., C, R],
    st [.., C, R/128]. Pass 1 finds the column (or tile) amax, quantizing the rows on the way where they have their
    own scales; pass 2 reads the chunks again (from cache) for what needs the tile's amax."""
    pid_r, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    cols = pid_c * BLOCK + tl.arange(0, BLOCK)
    c_ok = cols < C
    x_tile = x_ptr + b * stride_xb + (pid_r * BLOCK).to(tl.int64) * stride_xr
    col_amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for r0 in range(0, BLOCK, CHUNK):
        x, rows, r_ok, mask = _load_chunk(x_tile, r0, pid_r * BLOCK, R, cols, c_ok, stride_xr, CHUNK)
        col_amax = tl.maximum(col_amax, tl.max(tl.abs(x), axis=0))
        if not SQUARE:
            row_scale, row_inverse = _scale_and_inverse(tl.max(tl.abs(x), axis=1), FP8_MAX)
            q = tl.clamp(x * row_inverse[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + b * stride_qb + rows[:, None].to(tl.int64) * stride_qr + cols[None, :], q, mask=mask)
            tl.store(s_ptr + b * stride_sb + rows.to(tl.int64) * stride_sr + pid_c, row_scale, mask=r_ok)
    if SQUARE:
        scale, inverse = _scale_and_inverse(tl.max(col_amax, axis=0), FP8_MAX)
        tl.store(s_ptr + b * stride_sb + pid_r * stride_sr + pid_c, scale)
        col_inverse = tl.zeros((BLOCK,), dtype=tl.float32) + inverse
    else:
        col_scale, col_inverse = _scale_and_inverse(col_amax, FP8_MAX)
        tl.store(st_ptr + b * stride_stb + cols.to(tl.int64) * stride_stc + pid_r, col_scale, mask=c_ok)
    # One store of each quantized chunk: storing a chunk both as is and transposed wrote wrong q values on sm_90a
    # (Triton 3.6), so the weight blocks' transpose is a copy of q (``quantize_weight_blocks``).
    for r0 in range(0, BLOCK, CHUNK):
        x, rows, r_ok, mask = _load_chunk(x_tile, r0, pid_r * BLOCK, R, cols, c_ok, stride_xr, CHUNK)
        q = tl.clamp(x * col_inverse[None, :], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
        if SQUARE:
            tl.store(q_ptr + b * stride_qb + rows[:, None].to(tl.int64) * stride_qr + cols[None, :], q, mask=mask)
        else:
            qt_at = qt_ptr + b * stride_qtb + cols[:, None].to(tl.int64) * stride_qtc + rows[None, :]  # [C, rows]
            tl.store(qt_at, tl.trans(q), mask=c_ok[:, None] & r_ok[None, :])


def quantize_rows_and_cols(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, C] -> (q, s, qt, st) as the module doc says: one read of x."""
    M, C = x.shape
    fp8, dev = torch.float8_e4m3fn, x.device
    q, qt = torch.empty(M, C, dtype=fp8, device=dev), torch.empty(C, M, dtype=fp8, device=dev)
    s = torch.empty(M, triton.cdiv(C, BLOCK), dtype=torch.float32, device=dev)
    st = torch.empty(C, triton.cdiv(M, BLOCK), dtype=torch.float32, device=dev)
    if M == 0 or C == 0:
        return q, s, qt, st
    x = x if x.stride(1) == 1 else x.contiguous()
    _prepare()
    grid = (triton.cdiv(M, BLOCK), triton.cdiv(C, BLOCK), 1)
    launch(_quantize_tile_2d_kernel, grid, x, q, s, qt, st, M, C, 0, x.stride(0), 0, q.stride(0), 0, s.stride(0), 0,
           qt.stride(0), 0, st.stride(0), BLOCK=BLOCK, CHUNK=CHUNK, FP8_MAX=E4M3_MAX, SQUARE=False)
    return q, s, qt, st


def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [G, N, K] -> (q [G, N, K], qt [G, K, N], s [G, ceil(N / 128), ceil(K / 128)]): one read of w; qt is q
    transposed by a copy (once per optimizer step: the weights' FP8 bytes once more)."""
    G, N, K = w.shape
    fp8, dev = torch.float8_e4m3fn, w.device
    q = torch.empty(G, N, K, dtype=fp8, device=dev)
    s = torch.empty(G, triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK), dtype=torch.float32, device=dev)
    if G == 0 or N == 0 or K == 0:
        return q, q.transpose(1, 2).contiguous(), s
    w = w if w.is_contiguous() else w.contiguous()
    _prepare()
    grid = (triton.cdiv(N, BLOCK), triton.cdiv(K, BLOCK), G)
    launch(_quantize_tile_2d_kernel, grid, w, q, s, q, s, N, K, w.stride(0), w.stride(1), q.stride(0), q.stride(1),
           s.stride(0), s.stride(1), 0, 0, 0, 0, BLOCK=BLOCK, CHUNK=CHUNK, FP8_MAX=E4M3_MAX, SQUARE=True)
    return q, q.transpose(1, 2).contiguous(), s
