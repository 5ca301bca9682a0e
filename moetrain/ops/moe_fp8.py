"""The fused expert path in FP8 (rowwise and tensorwise recipes): the token rows are quantized, never permuted in
16 bits, and FC2 is one node with the combine.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M = T*K routed rows (sorted by expert;
offs [E] int32 group ends with offs[-1] = M: dropped assignments sit with the last expert, probs 0).

    forward                                                 backward
    xq [M, H], sx [M] = rows of x [T, H], each written      dh -> dx_rows = dgrad -> dx [T, H] = top-k sum
      to its K rows (quantize_rows scatter: x read once)     dw1 = wgrad(dh^T, x^T), x^T from the forward
    h [M, 2I] = FC1(xq)                                      (x^T per group's columns read through token_of_row)
    a [M, I]  = SwiGLU(h) * probs (16-bit, as the bf16 path)
    out [T, H] = top-k sum of FC2(a) (FC2's rows transient)  dout [T, H] quantized straight into its M rows (scatter)
                                                             for FC2's dgrad; dout^T through token_of_row for dw2
Against the unfused composition (``Experts.compute_rows`` after ``permute_tokens``) this writes no bf16 copy of x's
or dout's M rows and quantizes T rows instead of M for them: 1 byte a value moved instead of 2 + 2 + 1. The GEMMs,
the weight cache and the numerics are those of ``ops.grouped_gemm_fp8_scaled`` (the same quantized values).
"""

from __future__ import annotations

import torch

from moetrain.ops import moe_rows
from moetrain.ops.grouped_gemm_fp8_scaled import SCALED, _gemm, quantize_group_cols_for, quantize_rows_for
from moetrain.ops.moe_rows import combine_kernel


class _FC1FromTokens(torch.autograd.Function):
    """h [M, 2I] = x[token_of_row[r]] @ w1[e(r)]^T in FP8; x [T, H] (see the module doc)."""

    @staticmethod
    def forward(ctx, x, w1, offs, token_of_row, inverse, topk, recipe):
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        xq, sx = quantize_rows_for(x, recipe, scatter=inverse, topk=topk)
        wq, sw, _, _ = WEIGHTS.get(w1, recipe)
        h = _gemm("fwd", xq, wq.transpose(1, 2), sx, sw, offs)
        xt, sxt, padded = quantize_group_cols_for(x, offs, recipe, gather=token_of_row)
        ctx.save_for_backward(xt, sxt, padded, offs, inverse)
        ctx.w1, ctx.topk, ctx.recipe, ctx.x_dtype = w1, topk, recipe, x.dtype
        return h.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        xt, sxt, padded, offs, inverse = ctx.saved_tensors
        recipe = ctx.recipe
        dh = dh.contiguous()
        dhq, sdh = quantize_rows_for(dh, recipe)
        _, _, wqt, swt = WEIGHTS.get(ctx.w1, recipe)
        dx_rows = _gemm("dgrad", dhq, wqt.transpose(1, 2), sdh, swt, offs).to(ctx.x_dtype)
        dx = combine_kernel(dx_rows, inverse, None, ctx.topk)
        dht, sdht, _ = quantize_group_cols_for(dh, offs, recipe)
        dw1 = _gemm("wgrad", dht, xt.t(), sdht, sxt, padded).to(ctx.w1.dtype)
        return dx, dw1, None, None, None, None, None


class _FC2Combine(torch.autograd.Function):
    """out [T, H] = sum_k (a @ w2[e]^T)[inverse[t*K + k]] in FP8; a [M, I] (see the module doc)."""

    @staticmethod
    def forward(ctx, a, w2, offs, token_of_row, inverse, topk, recipe):
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        aq, sa = quantize_rows_for(a, recipe)
        wq, sw, _, _ = WEIGHTS.get(w2, recipe)
        y_rows = _gemm("fwd", aq, wq.transpose(1, 2), sa, sw, offs).to(a.dtype)
        out = combine_kernel(y_rows, inverse, None, topk)
        at, sat, padded = quantize_group_cols_for(a, offs, recipe)
        ctx.save_for_backward(at, sat, padded, offs, token_of_row, inverse)
        ctx.w2, ctx.topk, ctx.recipe, ctx.a_dtype = w2, topk, recipe, a.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        at, sat, padded, offs, token_of_row, inverse = ctx.saved_tensors
        recipe = ctx.recipe
        dout = dout.contiguous()
        dyq, sdy = quantize_rows_for(dout, recipe, scatter=inverse, topk=ctx.topk)
        _, _, wqt, swt = WEIGHTS.get(ctx.w2, recipe)
        da = _gemm("dgrad", dyq, wqt.transpose(1, 2), sdy, swt, offs).to(ctx.a_dtype)
        dyt, sdyt, _ = quantize_group_cols_for(dout, offs, recipe, gather=token_of_row)
        dw2 = _gemm("wgrad", dyt, at.t(), sdyt, sat, padded).to(ctx.w2.dtype)
        return da, dw2, None, None, None, None, None


def moe_experts_fp8(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, *, activation: str = "swiglu", recipe: str = "rowwise") -> torch.Tensor:
    """sum_k topk_weight[t, k] * FFN_{topk_idx[t, k]}(x[t]) with the expert GEMMs in FP8 ``recipe`` (rowwise or
    tensorwise; no expert biases). x [T, H] 16/32-bit; topk_idx [T, K] int64 (-1 dropped); topk_weight [T, K];
    w1 [E, 2I, H]; w2 [E, H, I]; H and I multiples of 16. Returns [T, H] in x.dtype. Needs triton (our row kernels;
    Triton's interpreter on the CPU, where the FP8 GEMMs are emulated)."""
    from moetrain.ops.moe import _SortWithWeights

    if recipe not in SCALED:
        raise ValueError(f"moe_experts_fp8: recipe {recipe!r} is not one of {', '.join(SCALED)}")
    E, K = w1.shape[0], topk_idx.shape[1]
    offs, _row_map, inverse, token_of_row, probs = _SortWithWeights.apply(topk_weight, topk_idx, E)
    h = _FC1FromTokens.apply(x, w1, offs, token_of_row, inverse, K, recipe)
    a = moe_rows.swiglu(h, activation, "triton", probs=probs)
    return _FC2Combine.apply(a, w2, offs, token_of_row, inverse, K, recipe)
