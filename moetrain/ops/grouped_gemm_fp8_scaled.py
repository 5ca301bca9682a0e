"""Rowwise and tensorwise FP8 grouped GEMMs: our quantizers (``kernels.fp8_rowwise``) feeding
``torch._scaled_grouped_mm`` (CUTLASS, one fp32 scale per row of each operand), forward, data gradient and weight
gradient, with autograd. References: ``ops.grouped_gemm_fp8`` (fp32 math on the same quantized values).

Shapes and dtypes (legend in ``ops.fp8_quant``): x [M, K], w [G, N, K] float; offs [G] int32 group ends; y [M, N]
in x's dtype (the GEMM writes bf16, torch's only FP8 output type; rows past offs[-1] are 0). K and N must be
multiples of 16 (the GEMM's 16-byte strides).

    GEMM      A (row-major, scaled along the reduction)   B (column-major)                       groups
    forward   x [M, K], per row (tensorwise: one scale)   w^T [G, K, N]: w's rows, per row       offs
    dgrad     dy [M, N], per row                          w [G, N, K]: a copy of w scaled per    offs
                                                          column (tensorwise: w's data)
    wgrad     dy^T [N, M'], per group and row             x [M', K] from x^T [K, M']             padded offs
Weight gradient operands are each group's rows transposed, padded to 16 rows (``quantize_group_cols``: the GEMM
needs group starts on 16-row boundaries), scales group-major [G * rows], as torch reads them. x^T is made in the
forward (FP8, half of x's bf16 bytes) and kept for the backward.

On CPU tensors (Triton's interpreter) the GEMM is ``scaled_grouped_mm_emulated``: the same arguments, fp32 math.
"""

from __future__ import annotations

import torch

from moetrain.config.schema import FP8_FUSED
from moetrain.ops.fp8_quant import scale_and_inverse

SCALED = FP8_FUSED  # the recipes of this op
ALIGN = 16  # rows: the weight gradient's group starts (TMA)
# The GEMMs that accumulate on Hopper's FP8 tensor cores without promoting partial sums to fp32 (use_fast_accum:
# fewer accumulator bits, up to 1.9x faster at Qwen3-30B-A3B shapes); the quantization's error dominates either
# way (SNR of y, dx and dw unchanged to 0.1 dB on the H200, bench/fp8_gemm.md), so all three do.
FAST_ACCUM = frozenset({"fwd", "dgrad", "wgrad"})


def scaled_grouped_mm_emulated(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                               offs: torch.Tensor) -> torch.Tensor:
    """torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype=bf16) in fp32 math, for CPU tests.
    2d x 3d: a [M, K], b [G, K, N], scale_a [M], scale_b [G, N] -> [M, N] (rows past offs[-1] left 0);
    2d x 2d: a [N, M'], b [M', K], scale_a [G * N], scale_b [G * K] -> [G, N, K]."""
    ends = offs.tolist()  # an emulation: host reads are fine
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        y = torch.zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends)):
            y[s:e] = (a[s:e].float() * scale_a[s:e, None]) @ (b[g].float() * scale_b[g][None, :])
        return y.to(torch.bfloat16)
    G, N, K = offs.shape[0], a.shape[0], b.shape[1]
    sa, sb = scale_a.view(G, N), scale_b.view(G, K)
    dw = torch.zeros(G, N, K)
    for g, (s, e) in enumerate(zip(starts, ends)):
        dw[g] = (a[:, s:e].float() * sa[g][:, None]) @ (b[s:e].float() * sb[g][None, :])
    return dw.to(torch.bfloat16)


def _gemm(op, a, b, scale_a, scale_b, offs) -> torch.Tensor:
    if a.device.type == "cuda":
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=op in FAST_ACCUM)
    return scaled_grouped_mm_emulated(a, b, scale_a, scale_b, offs)


def _tensor_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensorwise scale and inverse of x, 0-d fp32 tensors (on x's device: no host read)."""
    return scale_and_inverse(x.detach().abs().amax().float())


def quantize_rows_for(x: torch.Tensor, recipe: str, scatter: torch.Tensor | None = None, topk: int = 1
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q [R, C] fp8, s [R] fp32): per row (rowwise) or one scale repeated (tensorwise). With
    ``scatter`` [R * topk] (the routing's inverse), the token rows x land at their permuted rows: [R * topk]."""
    from moetrain.kernels.fp8_rowwise import quantize_rows

    if recipe == "rowwise":
        return quantize_rows(x, scatter=scatter, topk=topk)
    scale, inverse = _tensor_scale(x)
    q, _ = quantize_rows(x, inverse=inverse.expand(x.shape[0]), scatter=scatter, topk=topk)
    return q, scale.expand(q.shape[0]).contiguous()


def quantize_group_cols_for(x: torch.Tensor, offs: torch.Tensor, recipe: str, gather: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, C] -> (qt [C, M'] fp8 padded per group, s [G * C] fp32 group-major, padded offs [G] int32). With
    ``gather`` [M] int32 (each sorted row's token), x is the token rows [T, C] and row r is x[gather[r]]."""
    from moetrain.kernels.fp8_rowwise import quantize_group_cols

    G, C = offs.shape[0], x.shape[1]
    if recipe == "rowwise":
        qt, s, padded = quantize_group_cols(x, offs, align=ALIGN, gather=gather)
        return qt, s.view(G * C), padded
    scale, inverse = _tensor_scale(x)  # over the token rows: the permuted rows hold the same values
    qt, _, padded = quantize_group_cols(x, offs, align=ALIGN, inverse=inverse.expand(G).contiguous(), gather=gather)
    return qt, scale.expand(G * C).contiguous(), padded


def quantize_weight(w: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [G, N, K] -> (q [G, N, K], s [G, N]) for the forward and (qt [G, K, N], st [G, K]) for the data gradient:
    rowwise q per row, qt per column of each expert; tensorwise one scale per expert, qt w's data transposed."""
    from moetrain.kernels.fp8_rowwise import quantize_group_cols, quantize_rows

    G, N, K = w.shape
    rows = w.reshape(G * N, K)
    if recipe == "rowwise":
        q, s = quantize_rows(rows)
        ends = (torch.arange(1, G + 1, device=w.device) * N).to(torch.int32)
        qt, st, _ = quantize_group_cols(rows, ends, stacked=True)
        return q.view(G, N, K), s.view(G, N), qt, st
    scale, inverse = scale_and_inverse(w.abs().amax(dim=(1, 2)))  # [G]
    q, _ = quantize_rows(rows, inverse=inverse.repeat_interleave(N))
    q = q.view(G, N, K)
    return q, scale[:, None].expand(G, N).contiguous(), q.transpose(1, 2).contiguous(), \
        scale[:, None].expand(G, K).contiguous()


class _ScaledGroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, recipe):
        from moetrain.kernels.fp8_rowwise import zero_rows_past
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        xq, sx = quantize_rows_for(x, recipe)
        wq, sw, _, _ = WEIGHTS.get(w, recipe)
        y = zero_rows_past(_gemm("fwd", xq, wq.transpose(1, 2), sx, sw, offs), offs)
        xt, sxt, padded = quantize_group_cols_for(x, offs, recipe)
        ctx.save_for_backward(xt, sxt, padded, offs)
        ctx.w, ctx.recipe, ctx.x_dtype = w, recipe, x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        from moetrain.kernels.fp8_rowwise import zero_rows_past
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        xt, sxt, padded, offs = ctx.saved_tensors
        w, recipe = ctx.w, ctx.recipe
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dyq, sdy = quantize_rows_for(dy, recipe)
        _, _, wqt, swt = WEIGHTS.get(w, recipe)
        dx = zero_rows_past(_gemm("dgrad", dyq, wqt.transpose(1, 2), sdy, swt, offs), offs).to(ctx.x_dtype)
        dyt, sdyt, _ = quantize_group_cols_for(dy, offs, recipe)
        dw = _gemm("wgrad", dyt, xt.t(), sdyt, sxt, padded).to(w.dtype)
        return dx, dw, None, None


def grouped_gemm_fp8_scaled(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    """y [M, N] = x_g @ w_g^T in FP8 ``recipe`` (rowwise or tensorwise; the module doc), with autograd."""
    if recipe not in SCALED:
        raise ValueError(f"grouped_gemm_fp8_scaled: recipe {recipe!r} is not one of {', '.join(SCALED)}")
    N, K = w.shape[1], w.shape[2]
    if N % 16 or K % 16:
        raise ValueError(f"grouped_gemm_fp8_scaled: N {N} and K {K} must be multiples of 16 (the FP8 GEMM's "
                         "16-byte strides)")
    return _ScaledGroupedGemm.apply(x, w, offs, recipe)
