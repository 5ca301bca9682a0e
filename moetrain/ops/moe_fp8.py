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
or dout's M rows and quantizes T rows instead of M for them: 1 byte a value moved instead of 2 + 2 + 1. On CUDA the
tuner measures that ("scatter") against quantizing a transient 16-bit copy of the rows ("copy") once per shape
(``quantize_token_rows``). The GEMMs, the weight cache and the numerics are those of
``ops.grouped_gemm_fp8_scaled`` (the same quantized values either way).
"""

from __future__ import annotations

import torch

from moetrain import tuning
from moetrain.ops import moe_rows
from moetrain.ops.grouped_gemm_fp8_scaled import SCALED, _gemm, quantize_group_cols_for, quantize_rows_for
from moetrain.ops.moe_fused import _on_both_token_orders
from moetrain.ops.moe_rows import combine_kernel, token_rows_kernel

# How a GEMM operand made of permuted token rows is quantized (``quantize_token_rows``); first the one that runs
# inside a CUDA graph captured before the tuner measured
TOKEN_ROWS_VARIANTS = ("scatter", "copy")


def quantize_token_rows(x: torch.Tensor, offs: torch.Tensor, token_of_row: torch.Tensor, inverse: torch.Tensor,
                        topk: int, recipe: str) -> tuple[torch.Tensor, ...]:
    """The FP8 operands of the permuted rows x[token_of_row] [M, C] (x [T, C] token rows): (q [M, C], s [M]) for
    the GEMM over the rows and (qt, st, padded offs) for the weight gradient (``grouped_gemm_fp8_scaled``).
    "scatter": the row quantizer writes each token row at its topk rows and the column quantizer reads through
    token_of_row; "copy": the rows written once in 16 bits, both quantizers on them, the copy freed. On CUDA the
    tuner measures both once per shape: with few groups (Mixtral's 8) the gathered column reads, each waiting on
    its index, can cost more than the copy."""
    variant = "scatter"
    if x.is_cuda:
        M, C, G = token_of_row.shape[0], x.shape[1], offs.shape[0]
        variant = tuning.choose(f"fp8_token_rows_{recipe}", x, C, 0, M, G, TOKEN_ROWS_VARIANTS,
                                _on_both_token_orders(token_of_row, inverse, topk, lambda name, rows, inv:
                                                      _quantize_token_rows(name, x, offs, rows, inv, topk, recipe)),
                                fallback="scatter")
    return _quantize_token_rows(variant, x, offs, token_of_row, inverse, topk, recipe)


def _quantize_token_rows(variant: str, x, offs, token_of_row, inverse, topk: int, recipe: str) -> tuple:
    if variant == "scatter":
        q, s = quantize_rows_for(x, recipe, scatter=inverse, topk=topk)
        return (q, s, *quantize_group_cols_for(x, offs, recipe, gather=token_of_row))
    rows = token_rows_kernel(x, inverse, token_of_row.shape[0])
    return (*quantize_rows_for(rows, recipe), *quantize_group_cols_for(rows, offs, recipe))


class _FC1FromTokens(torch.autograd.Function):
    """h [M, 2I] = x[token_of_row[r]] @ w1[e(r)]^T in FP8; x [T, H] (see the module doc)."""

    @staticmethod
    def forward(ctx, x, w1, offs, token_of_row, inverse, topk, recipe):
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        xq, sx, xt, sxt, padded = quantize_token_rows(x, offs, token_of_row, inverse, topk, recipe)
        wq, sw, _, _ = WEIGHTS.get(w1, recipe)
        h = _gemm("fwd", xq, wq.transpose(1, 2), sx, sw, offs)
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
        dyq, sdy, dyt, sdyt, _ = quantize_token_rows(dout, offs, token_of_row, inverse, ctx.topk, recipe)
        _, _, wqt, swt = WEIGHTS.get(ctx.w2, recipe)
        da = _gemm("dgrad", dyq, wqt.transpose(1, 2), sdy, swt, offs).to(ctx.a_dtype)
        del dyq, sdy  # [M, H] FP8: freed before the weight gradient's GEMM
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
