"""MXFP8 (E4M3 data, one power-of-two E8M0 scale per 1 x 32 along the reduction) quantizer and grouped GEMMs in
Triton. References: ``ops.fp8_quant.quantize(x, "mxfp8")`` (bit for bit) and ``ops.grouped_gemm_fp8`` (fp32 math on
the same quantized values); the op with autograd: ``ops.grouped_gemm_fp8_mx``.

Shapes and dtypes (legend in ``ops.fp8_quant``; E8M0: uint8 e, the scale 2^(e - 127)):
    quantize_mx:         x [R, C] or [B, R, C] float, any strides -> (q [.., R, C] float8_e4m3fn contiguous,
                         s [.., R, ceil(C / 32)] uint8 E8M0), each 1 x 32 tile along C scaled by the smallest power of
                         two >= amax / 448 (1 for an all-zero tile), partial last tile by its own values
    grouped_gemm_mx:     a [M, K] fp8, sa [M, K / 32]; b [G, N, K] fp8, sb [G, N, K / 32]; offs [G] int32 cumulative
                         row ends -> y [M, N] out_dtype (y_g = dequant(a_g) @ dequant(b_g)^T; rows past offs[-1] 0)
    grouped_wgrad_mx:    at [N, M] fp8, sat [N, ceil(M / 32)]; bt [K, M] fp8, sbt [K, ceil(M / 32)] (dy^T and x^T
                         quantized along M in 1 x 32 tiles of the whole tensor) -> dw [G, N, K] out_dtype, dw_g the
                         sum over the rows of group g (a tile meeting two groups is one scale for both, as the
                         reference); an empty group's dw is 0
K (the reduction of grouped_gemm_mx) must be a multiple of 32: the E8M0 scales come in whole 1 x 32 tiles.

The GEMMs take one step per BLOCK_K slice of the reduction. DOT_SCALED (compiled kernels): ``tl.dot_scaled`` on
the FP8 tiles and their scales ([rows, BLOCK_K / 32] for both operands, b's rows being the output's columns), which
Blackwell (sm_100a) runs on its block-scaled tensor cores (tcgen05.mma kind::mxf8f6f4.block_scale) and Hopper in
Triton's emulation (the tiles upcast to bf16 and scaled, then a bf16 wgmma: exact products, correct, not fast).
Without it (Triton 3.6's interpreter has no dot_scaled): the tiles dequantized in the kernel (each [rows, BLOCK_K / 32,
32] group times 2^(e - 127)) and an fp32 ``tl.dot``, in the same loop. The row tiles of each group are found on the
device from offs (as ``fp8_blockwise``): no host sync.

Not fast yet (tests/kernels/test_fp8_mx_sm100.py compiles them, Triton 3.6): on sm_100a the pointer loads are not
software-pipelined (33280 bytes of shared memory at 128 x 128 x 128, num_stages=3: one stage of both FP8 tiles and
their scales; TMA descriptors would be the next step); the sm_90a emulation spills (~1.4-1.9 KB at that tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.fp8_blockwise import _band_row_tile
from moetrain.kernels.grouped_gemm_configs import interpreter_rounding_shim, interpreter_numpy_shim, interpreting
from moetrain.kernels.launch import launch

MX = 32  # values per scale
E4M3_MAX = 448.0
SCALE_ONE = 127  # E8M0 of 1.0


def e8m0_to_fp32(s: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents (any shape) -> fp32 scales 2^(s - 127), exactly (torch only)."""
    return torch.ldexp(torch.ones(s.shape, dtype=torch.float32, device=s.device), s.to(torch.int32) - SCALE_ONE)


def _prepare() -> None:
    if interpreting():
        interpreter_numpy_shim()
        interpreter_rounding_shim()


@triton.jit
def _e8m0_and_inverse(amax, FP8_MAX: tl.constexpr):
    """fp32 amax -> (int32 biased exponent e of the smallest power of two >= amax / 448, at least 2^-127; 127 where
    amax is 0, and 2^(127 - e), the tile's exact inverse scale). From the bits of amax / 448 (one IEEE division):
    a normal float with exponent field E rounds up to E + 1 unless its mantissa is 0; a subnormal one (E = 0) is
    at most 2^-127 (e = 0) unless its mantissa exceeds 2^-127's."""
    s = tl.where(amax > 0, tl.div_rn(amax, FP8_MAX), 1.0)
    bits = s.to(tl.int32, bitcast=True)
    exp_field = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    e = tl.where(exp_field == 0, (mantissa > 0x400000).to(tl.int32), exp_field + (mantissa != 0).to(tl.int32))
    inverse = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return e, inverse


@triton.jit
def _quantize_mx_kernel(x_ptr, q_ptr, s_ptr, R, C, stride_xb, stride_xr, stride_xc, stride_qb, stride_qr,
                        stride_sb, stride_sr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP8_MAX: tl.constexpr):
    pid_r, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + b * stride_xb + rows[:, None].to(tl.int64) * stride_xr + cols[None, :].to(tl.int64) * stride_xc,
                mask=mask, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, (BLOCK_R, BLOCK_C // 32, 32))
    e, inverse = _e8m0_and_inverse(tl.max(tl.abs(x3), axis=2), FP8_MAX)
    q = tl.reshape(tl.clamp(x3 * inverse[:, :, None], -FP8_MAX, FP8_MAX), (BLOCK_R, BLOCK_C))
    tl.store(q_ptr + b * stride_qb + rows[:, None].to(tl.int64) * stride_qr + cols[None, :],
             q.to(q_ptr.dtype.element_ty), mask=mask)
    tiles = pid_c * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    tl.store(s_ptr + b * stride_sb + rows[:, None].to(tl.int64) * stride_sr + tiles[None, :], e.to(tl.uint8),
             mask=(rows[:, None] < R) & (tiles[None, :] < tl.cdiv(C, 32)))


def quantize_mx(x: torch.Tensor, block_r: int = 32, block_c: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] or [B, R, C] (any strides: x.t() quantizes along the rows of x, reading it in place) -> (q, s) as the
    module doc says. One read of x, tiles of block_r x block_c (block_c a multiple of 32)."""
    if x.dim() not in (2, 3) or block_c % MX:
        raise ValueError(f"quantize_mx: x must be [R, C] or [B, R, C] (got {tuple(x.shape)}), block_c a multiple of 32")
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    B, R, C = x3.shape
    q = torch.empty(B, R, C, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(B, R, triton.cdiv(C, MX), dtype=torch.uint8, device=x.device)
    if B and R and C:
        _prepare()
        grid = (triton.cdiv(R, block_r), triton.cdiv(C, block_c), B)
        launch(_quantize_mx_kernel, grid, x3, q, s, R, C, x3.stride(0), x3.stride(1), x3.stride(2), q.stride(0),
               q.stride(1), s.stride(0), s.stride(1), BLOCK_R=block_r, BLOCK_C=block_c, FP8_MAX=E4M3_MAX)
    return (q, s) if x.dim() == 3 else (q[0], s[0])


@triton.jit
def _dequantize_tile(t, s, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8 t [ROWS, BLOCK_K], uint8 E8M0 s [ROWS, BLOCK_K / 32] -> fp32 t * 2^(s - 127) (exact)."""
    scale = tl.exp2(s.to(tl.float32) - 127.0)
    t3 = tl.reshape(t.to(tl.float32), (ROWS, BLOCK_K // 32, 32))
    return tl.reshape(t3 * scale[:, :, None], (ROWS, BLOCK_K))


@triton.jit
def _mx_step(acc, a, sa, b, sb, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT_SCALED: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 + dequant(a [BLOCK_M, BLOCK_K]) @ dequant(b [BLOCK_N, BLOCK_K])^T."""
    if DOT_SCALED:
        acc = tl.dot_scaled(a, sa, "e4m3", tl.trans(b), sb, "e4m3", acc)
    else:
        af = _dequantize_tile(a, sa, BLOCK_M, BLOCK_K)
        bf = _dequantize_tile(b, sb, BLOCK_N, BLOCK_K)
        acc = tl.dot(af, tl.trans(bf), acc, input_precision="ieee")
    return acc


@triton.jit
def _grouped_mx_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, y_ptr, offs_ptr, M, N, K, G, ROW_TILES,
                       stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                       GROUP_M: tl.constexpr, DOT_SCALED: tl.constexpr):
    live, g, rows, row_end, pid_n = _band_row_tile(offs_ptr, M, N, G, ROW_TILES, BLOCK_M, BLOCK_N, BLOCK_G, GROUP_M)
    if not live:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < row_end, cols < N
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + g.to(tl.int64) * stride_bg + cols[:, None].to(tl.int64) * stride_bn
    sa_rows = sa_ptr + rows[:, None].to(tl.int64) * stride_sam
    sb_rows = sb_ptr + g.to(tl.int64) * stride_sbg + cols[:, None].to(tl.int64) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        t = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        k_ok, t_ok = k < K, t < K // 32
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_rows + t[None, :], mask=row_ok[:, None] & t_ok[None, :], other=127)
        sb = tl.load(sb_rows + t[None, :], mask=col_ok[:, None] & t_ok[None, :], other=127)
        acc = _mx_step(acc, a, sa, b, sb, BLOCK_M, BLOCK_N, BLOCK_K, DOT_SCALED)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm_mx(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, dot_scaled: bool | None = None, block_m: int = 128,
                    block_n: int = 128, block_k: int = 128, num_warps: int = 8, num_stages: int = 3,
                    group_m: int = 8) -> torch.Tensor:
    """y [M, N] = the MXFP8 grouped GEMM (the module doc). ``dot_scaled``: tl.dot_scaled (default: on CUDA tensors)
    or the in-kernel dequantization; tile (block_m, block_n, block_k), bands of group_m row tiles."""
    M, K = a.shape
    G, N, _ = b.shape
    if K % MX:
        raise ValueError(f"grouped_gemm_mx: the reduction K = {K} (a {tuple(a.shape)}, b {tuple(b.shape)}) must be "
                         "a multiple of 32 (whole MX scale tiles)")
    if b.shape[2] != K or sa.shape != (M, K // MX) or sb.shape != (G, N, K // MX) or block_k % MX:
        raise ValueError(f"grouped_gemm_mx: a {tuple(a.shape)}, sa {tuple(sa.shape)}, b {tuple(b.shape)}, sb "
                         f"{tuple(sb.shape)} do not match ([M, K], [M, K/32], [G, N, K], [G, N, K/32])")
    y = torch.zeros(M, N, dtype=out_dtype, device=a.device)  # rows of no group stay 0
    if M == 0 or N == 0 or G == 0:
        return y
    _prepare()
    row_tiles = triton.cdiv(M, block_m) + G  # each group adds at most one partial tile
    launch(_grouped_mx_kernel, (row_tiles * triton.cdiv(N, block_n),), a, sa, b, sb, y, offs, M, N, K, G, row_tiles,
           a.stride(0), sa.stride(0), b.stride(0), b.stride(1), sb.stride(0), sb.stride(1), y.stride(0),
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_G=triton.next_power_of_2(G), GROUP_M=group_m,
           DOT_SCALED=a.is_cuda if dot_scaled is None else bool(dot_scaled), num_warps=num_warps,
           num_stages=num_stages)
    return y


@triton.jit
def _grouped_wgrad_mx_kernel(at_ptr, sat_ptr, bt_ptr, sbt_ptr, dw_ptr, offs_ptr, M, N, K,
                             stride_atn, stride_satn, stride_btk, stride_sbtk, stride_dwg, stride_dwn,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                             DOT_SCALED: tl.constexpr):
    pid_n, pid_k, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    end = tl.minimum(tl.load(offs_ptr + g), M)
    start = tl.minimum(tl.load(offs_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0), end)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok, k_ok = n < N, k < K
    a_rows = at_ptr + n[:, None].to(tl.int64) * stride_atn
    b_rows = bt_ptr + k[:, None].to(tl.int64) * stride_btk
    sa_rows = sat_ptr + n[:, None].to(tl.int64) * stride_satn
    sb_rows = sbt_ptr + k[:, None].to(tl.int64) * stride_sbtk
    tiles_m = tl.cdiv(M, 32)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # slices of BLOCK_R rows from the 32-row tile holding the group's first row; rows of other groups masked to 0
    for r0 in range((start // 32) * 32, end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        t = r0 // 32 + tl.arange(0, BLOCK_R // 32)
        r_ok, t_ok = (r >= start) & (r < end), t < tiles_m
        a = tl.load(a_rows + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_rows + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        sa = tl.load(sa_rows + t[None, :], mask=n_ok[:, None] & t_ok[None, :], other=127)
        sb = tl.load(sb_rows + t[None, :], mask=k_ok[:, None] & t_ok[None, :], other=127)
        acc = _mx_step(acc, a, sa, b, sb, BLOCK_N, BLOCK_K, BLOCK_R, DOT_SCALED)
    tl.store(dw_ptr + g.to(tl.int64) * stride_dwg + n[:, None].to(tl.int64) * stride_dwn + k[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def grouped_wgrad_mx(at: torch.Tensor, sat: torch.Tensor, bt: torch.Tensor, sbt: torch.Tensor, offs: torch.Tensor,
                     out_dtype: torch.dtype = torch.float32, dot_scaled: bool | None = None, block_n: int = 128,
                     block_k: int = 128, block_r: int = 128, num_warps: int = 8, num_stages: int = 3
                     ) -> torch.Tensor:
    """dw [G, N, K] = the MXFP8 weight gradient (the module doc): dw_g = dequant(at[:, rows of g]) @ dequant(bt[:,
    rows of g])^T; output tiles block_n x block_k, block_r rows (a multiple of 32) per step."""
    N, M = at.shape
    K, G = bt.shape[0], offs.shape[0]
    tiles = triton.cdiv(M, MX)
    if bt.shape[1] != M or sat.shape != (N, tiles) or sbt.shape != (K, tiles) or block_r % MX:
        raise ValueError(f"grouped_wgrad_mx: at {tuple(at.shape)}, sat {tuple(sat.shape)}, bt {tuple(bt.shape)}, "
                         f"sbt {tuple(sbt.shape)} do not match ([N, M], [N, ceil(M/32)], [K, M], [K, ceil(M/32)])")
    dw = torch.empty(G, N, K, dtype=out_dtype, device=at.device)
    if G == 0 or N == 0 or K == 0:
        return dw
    _prepare()
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k), G)
    launch(_grouped_wgrad_mx_kernel, grid, at, sat, bt, sbt, dw, offs, M, N, K, at.stride(0), sat.stride(0),
           bt.stride(0), sbt.stride(0), dw.stride(0), dw.stride(1), BLOCK_N=block_n, BLOCK_K=block_k,
           BLOCK_R=block_r, DOT_SCALED=at.is_cuda if dot_scaled is None else bool(dot_scaled), num_warps=num_warps,
           num_stages=num_stages)
    return dw
