"""FP8 quantization kernels of the rowwise and tensorwise recipes, whose GEMMs are ``torch._scaled_grouped_mm``
(CUTLASS; one fp32 scale per row of each operand). Reference: ``moetrain.ops.fp8_quant`` (the same rule: one IEEE
division per scale and its inverse, the elements multiplied by the inverse; bit for bit).

Shapes and dtypes (legend in ``ops.fp8_quant``):
    quantize_rows:        x [R, C] float -> (q [R, C] float8_e4m3fn, s [R] float32): each row scaled over its C
                          values; or, given ``inverse`` [R] (a tensorwise scale repeated; stride 0 is fine), each
                          row multiplied by it (s is then the caller's). Given ``scatter`` [R * K] (the
                          routing's inverse), each token row lands at its K permuted rows: q [R * K, C], s [R * K].
    quantize_group_cols:  x [M, C] float, offs [G] int32 group ends -> (qt, s [G, C] float32): each column of each
                          group's rows scaled over those rows, written transposed, K-major for the GEMM that
                          reduces over the rows:
                          padded (activations): qt [C, >= M + G * (align - 1), a multiple of 16], group g's rows
                                  at out_offs[g - 1] on, zero up to a multiple of ``align`` (the weight gradient's
                                  TMA alignment), out_offs [G] int32 the padded group ends; columns past
                                  out_offs[-1] belong to no group and stay unwritten (nothing reads them);
                          stacked (weights, every group N rows, M = G * N): qt [G, C, N], the transpose of each.
                          Given ``inverse`` [G], each group is multiplied by its value instead. Given
                          ``gather`` [M] (each sorted row's token), x is the token rows and row r reads x[gather[r]].
    zero_rows_past:       y [M, N] -> y with the rows at and past offs[-1] zeroed (what torch's grouped GEMM
                          leaves unwritten), touching only those rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.fp8_quantize import _scale_and_inverse
from moetrain.kernels.grouped_gemm_configs import interpreter_rounding_shim, interpreter_numpy_shim, interpreting
from moetrain.kernels.launch import launch

E4M3_MAX = 448.0
BLOCK_C = 128  # columns per chunk
BLOCK_R = 32  # rows per program (rows kernel) or per chunk (group columns kernel)


def _prepare() -> None:
    if interpreting():
        interpreter_numpy_shim()
        interpreter_rounding_shim()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, inv_ptr, dest_ptr, R, C, TOPK, stride_xr, stride_qr, stride_inv,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP8_MAX: tl.constexpr, GIVEN: tl.constexpr,
                          SCATTER: tl.constexpr):
    """BLOCK_R rows: pass 1 finds each row's amax over all C (unless GIVEN), pass 2 scales and stores, each row at
    its own place or (SCATTER) at the TOPK places dest[row * TOPK + k], its scale beside each."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < R
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xr
    if GIVEN:
        inverse = tl.load(inv_ptr + rows.to(tl.int64) * stride_inv, mask=r_ok, other=1.0)
    else:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            x = tl.load(x_rows + cols[None, :], mask=r_ok[:, None] & (cols[None, :] < C), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale, inverse = _scale_and_inverse(amax, FP8_MAX)
        if SCATTER:
            for k in range(TOPK):
                dest = tl.load(dest_ptr + rows.to(tl.int64) * TOPK + k, mask=r_ok, other=0)
                tl.store(s_ptr + dest, scale, mask=r_ok)
        else:
            tl.store(s_ptr + rows, scale, mask=r_ok)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = r_ok[:, None] & (cols[None, :] < C)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x * inverse[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
        if SCATTER:
            for k in range(TOPK):
                dest = tl.load(dest_ptr + rows.to(tl.int64) * TOPK + k, mask=r_ok, other=0)
                tl.store(q_ptr + dest[:, None] * stride_qr + cols[None, :], q, mask=mask)
        else:
            tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qr + cols[None, :], q, mask=mask)


def quantize_rows(x: torch.Tensor, inverse: torch.Tensor | None = None, scatter: torch.Tensor | None = None,
                  topk: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [R, C] -> (q [R, C] float8_e4m3fn, s [R] float32), each row over its own amax; with ``inverse`` [R], every
    row multiplied by it, and s None (the caller holds the scales). With ``scatter`` [R * topk] int64 (the routing's
    inverse: the row of each assignment t * topk + k), q [R * topk, C] and s [R * topk] hold row t at each of its
    topk rows: the permuted rows quantized from the token rows, read once."""
    R, C = x.shape
    out_rows = R if scatter is None else scatter.shape[0]
    if scatter is not None and out_rows != R * topk:
        raise ValueError(f"quantize_rows: scatter has {out_rows} rows, not {R} x topk {topk}")
    q = torch.empty(out_rows, C, dtype=torch.float8_e4m3fn, device=x.device)
    s = None if inverse is not None else torch.empty(out_rows, dtype=torch.float32, device=x.device)
    if R == 0 or C == 0:
        return q, s
    x = x if x.stride(1) == 1 else x.contiguous()
    _prepare()
    inv = inverse if inverse is not None else q  # unused when not GIVEN
    launch(_quantize_rows_kernel, (triton.cdiv(R, BLOCK_R),), x, q, s if s is not None else q, inv,
           scatter if scatter is not None else q, R, C, topk, x.stride(0), q.stride(0),
           inverse.stride(0) if inverse is not None else 0, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, FP8_MAX=E4M3_MAX,
           GIVEN=inverse is not None, SCATTER=scatter is not None)
    return q, s


@triton.jit
def _row_ptrs(x_ptr, src_ptr, rows, end, stride_xm, GATHER: tl.constexpr):
    """[BLOCK_R, 1] pointers to the rows' starts: x's rows, or (GATHER) x's rows src[rows] (rows past end: row 0)."""
    if GATHER:
        src = tl.load(src_ptr + rows, mask=rows < end, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    return x_ptr + src[:, None] * stride_xm


@triton.jit
def _quantize_group_cols_kernel(x_ptr, src_ptr, offs_ptr, out_ends_ptr, qt_ptr, s_ptr, inv_ptr, M, C, stride_xm,
                                stride_qg, stride_qc, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                FP8_MAX: tl.constexpr, PADDED: tl.constexpr, GIVEN: tl.constexpr,
                                GATHER: tl.constexpr):
    """BLOCK_C columns of group g's rows: pass 1 their amax over the group (unless GIVEN), pass 2 scales them and
    stores them transposed at the group's place (its padded start, or its own [C, N] slab), padding zeroed. Row r
    is x's row r, or (GATHER) x's row src[r]."""
    pid_c, g = tl.program_id(0), tl.program_id(1)
    end = tl.minimum(tl.load(offs_ptr + g), M)
    start = tl.minimum(tl.load(offs_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0), end)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    if PADDED:
        out_end = tl.load(out_ends_ptr + g)
        out_start = tl.load(out_ends_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0)
    else:
        out_start = 0
        out_end = end - start
    if GIVEN:
        inverse = tl.zeros((BLOCK_C,), dtype=tl.float32) + tl.load(inv_ptr + g)
    else:
        amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            x = tl.load(_row_ptrs(x_ptr, src_ptr, rows, end, stride_xm, GATHER) + cols[None, :],
                        mask=(rows[:, None] < end) & c_ok[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
        scale, inverse = _scale_and_inverse(amax, FP8_MAX)
        tl.store(s_ptr + g.to(tl.int64) * C + cols, scale, mask=c_ok)
    qt_group = qt_ptr + g.to(tl.int64) * stride_qg + cols[:, None].to(tl.int64) * stride_qc  # [BLOCK_C, 1]
    for r0 in range(0, out_end - out_start, BLOCK_R):  # the group's rows, then its zero padding
        at = r0 + tl.arange(0, BLOCK_R)
        rows = start + at
        x = tl.load(_row_ptrs(x_ptr, src_ptr, rows, end, stride_xm, GATHER) + cols[None, :],
                    mask=(rows[:, None] < end) & c_ok[None, :], other=0.0).to(tl.float32)
        q = tl.clamp(x * inverse[None, :], -FP8_MAX, FP8_MAX).to(qt_ptr.dtype.element_ty)
        tl.store(qt_group + (out_start + at)[None, :], tl.trans(q),
                 mask=c_ok[:, None] & (at[None, :] < out_end - out_start))


def padded_group_ends(offs: torch.Tensor, align: int) -> torch.Tensor:
    """offs [G] int32 group ends -> the ends when every group is padded to a multiple of ``align`` rows (int32, on
    offs' device; no host read)."""
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).clamp_min(0)
    return torch.cumsum((counts + align - 1) // align * align, 0).to(torch.int32)


def quantize_group_cols(x: torch.Tensor, offs: torch.Tensor, align: int = 16, stacked: bool = False,
                        inverse: torch.Tensor | None = None, gather: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x [M, C], offs [G] -> (qt, s, out_offs) as the module doc says: padded to ``align`` (activations), or
    ``stacked`` (weights: [G, C, N], out_offs = offs). ``inverse`` [G]: the groups' given multipliers (s None).
    ``gather`` [M] int32 (each sorted row's token): x is the token rows [T, C] and row r is x[gather[r]], so the
    permuted rows are never written."""
    M, C = x.shape if gather is None else (gather.shape[0], x.shape[1])
    G = offs.shape[0]
    fp8, dev = torch.float8_e4m3fn, x.device
    if stacked:
        if M % max(G, 1):
            raise ValueError(f"quantize_group_cols: stacked rows {M} are not {G} groups of equal size")
        N = M // max(G, 1)
        qt = torch.empty(G, C, N, dtype=fp8, device=dev)
        out_offs = offs
        stride_qg, stride_qc = qt.stride(0), qt.stride(1)
    else:
        out_offs = padded_group_ends(offs, align)
        width = (M + G * (align - 1) + 15) // 16 * 16  # a 16-byte row stride, as the GEMM's TMA needs
        qt = torch.empty(C, width, dtype=fp8, device=dev)
        stride_qg, stride_qc = 0, qt.stride(0)
    s = None if inverse is not None else torch.empty(G, C, dtype=torch.float32, device=dev)
    if G == 0 or C == 0:
        return qt, s, out_offs
    x = x if x.stride(1) == 1 else x.contiguous()
    _prepare()
    launch(_quantize_group_cols_kernel, (triton.cdiv(C, BLOCK_C), G), x, gather if gather is not None else offs,
           offs, out_offs, qt,
           s if s is not None else qt, inverse if inverse is not None else qt, M, C, x.stride(0), stride_qg,
           stride_qc, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, FP8_MAX=E4M3_MAX, PADDED=not stacked,
           GIVEN=inverse is not None, GATHER=gather is not None)
    return qt, s, out_offs


@triton.jit
def _zero_rows_past_kernel(y_ptr, offs_ptr, M, N, G, stride_ym, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    first = tl.load(offs_ptr + G - 1)
    if tl.program_id(0) * BLOCK_R + BLOCK_R <= first:
        return
    r_ok = (rows >= first) & (rows < M)
    zeros = tl.zeros((BLOCK_R, BLOCK_N), dtype=y_ptr.dtype.element_ty)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], zeros,
                 mask=r_ok[:, None] & (cols[None, :] < N))


def zero_rows_past(y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y [M, N] with rows offs[-1]..M-1 set to 0, in place (programs before offs[-1] return at once); y."""
    M, N = y.shape
    if M == 0 or N == 0 or offs.shape[0] == 0:
        return y
    _prepare()
    launch(_zero_rows_past_kernel, (triton.cdiv(M, BLOCK_R),), y, offs, M, N, offs.shape[0], y.stride(0),
           BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_C)
    return y
