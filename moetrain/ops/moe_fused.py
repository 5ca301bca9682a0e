"""FC1 of the fused expert path: token rows gathered inside the GEMM.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M = T*K routed rows.

    h [M, 2I] = x[token_of_row[r]] @ w1[e(r)]^T     rows r sorted by expert (``permute``'s order)

Forward: our Triton grouped GEMM reads the A rows of x [T, H] through token_of_row = row_map // K,
so the permuted copy x_perm [M, H] is never materialized, and autograd saves x (the layer input,
alive anyway) and the routing instead of x_perm. With gemm "auto", this "gather" forward is measured
once per shape against "copy": x_perm built by a gather, fed to the auto-chosen forward GEMM and
freed at once (TMA loads of A and torch's GEMM may beat pointer-gathered loads by more than the
copy costs). Either way autograd keeps the same tensors.
Backward (``gemm`` picks the GEMM backend: "triton", or "auto" = each op's measured winner):
    dx_perm [M, H] = dgrad(dh, w1)                          (grouped GEMM)
    dx[t]          = sum_k dx_perm[inverse[t*K + k]]        (Triton combine without weights: each
                                                            token owns its K rows; no atomics)
    dw1            = wgrad(dh, x_perm)                      "copy": x_perm gathered again, transiently;
                                                            "gather": our wgrad kernel reads x through
                                                            the index (auto measures both per shape)
Dropped assignments (-1) sit with the last expert (see ``permute``); the combine gives their rows
zero gradient, so they add nothing to dx or dw1.
"""

from __future__ import annotations

import torch

from moetrain.ops import autoselect
from moetrain.ops.grouped_gemm import grouped_gemm_op
from moetrain.ops.moe_rows import combine


def _fc1_forward(variant: str, gemm: str, x, w1, offs, token_of_row):
    """h = x[token_of_row] @ w1_g^T: "gather" reads x through the index in our kernel; "copy" gathers
    x_perm and runs the forward GEMM on ``gemm``; x_perm is freed on return."""
    if variant == "gather":
        from moetrain.kernels import grouped_gemm as kernels  # imports triton: only on this path

        return kernels.grouped_gemm_fwd(x, w1, offs, gather_rows=token_of_row)
    return grouped_gemm_op("fwd", gemm, x.index_select(0, token_of_row), w1, offs, w1.shape)


def _fc1_wgrad(variant: str, gemm: str, dh, x, offs, token_of_row, w_shape):
    """dw1 = dh_g^T @ x[token_of_row]_g, the same two variants as ``_fc1_forward``."""
    if variant == "gather":
        from moetrain.kernels import grouped_gemm as kernels

        return kernels.grouped_gemm_wgrad(dh, x, offs, gather_rows=token_of_row)
    return grouped_gemm_op("wgrad", gemm, dh, x.index_select(0, token_of_row), offs, w_shape)


class GatherFC1(torch.autograd.Function):
    """h = grouped_gemm(x[token_of_row], w1, offs) without materializing x[token_of_row]."""

    @staticmethod
    def forward(ctx, x, w1, offs, token_of_row, inverse, topk, gemm):
        offs = offs.to(torch.int32)
        ctx.save_for_backward(x, w1, offs, inverse, token_of_row)
        ctx.topk, ctx.gemm = topk, gemm
        variant = "gather"
        if gemm == "auto":
            G, N, K = w1.shape
            variant = autoselect.choose("moe_fc1_fwd", x, N, K, token_of_row.shape[0], G,
                                        lambda name: _fc1_forward(name, "auto", x, w1, offs, token_of_row))
        return _fc1_forward(variant, gemm, x, w1, offs, token_of_row)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        x, w1, offs, inverse, token_of_row = ctx.saved_tensors
        dh = dh.to(x.dtype).contiguous()
        dx = dw1 = None
        if ctx.needs_input_grad[0]:
            # dx_perm [M, H] is freed before the weight gradient runs (its "copy" variant gathers another
            # [M, H]): held, the two were the layer's peak (DeepSeek-V3: +0.9 GiB, bench/NOTES.md session 9)
            dx = combine(grouped_gemm_op("dgrad", ctx.gemm, dh, w1, offs, w1.shape), inverse, None, ctx.topk, "triton")
        if ctx.needs_input_grad[1]:
            variant = "copy"
            if ctx.gemm == "auto":
                G, N, K = w1.shape
                variant = autoselect.choose("moe_fc1_wgrad", dh, N, K, dh.shape[0], G,
                                            lambda name: _fc1_wgrad(name, "auto", dh, x, offs, token_of_row, w1.shape))
            dw1 = _fc1_wgrad(variant, ctx.gemm, dh, x, offs, token_of_row, w1.shape)
        return dx, dw1, None, None, None, None, None


def fc1_gathered(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, token_of_row: torch.Tensor,
                 inverse: torch.Tensor, topk: int, gemm: str = "triton") -> torch.Tensor:
    """x [T, H], w1 [E, 2I, H], offs [E] int32, token_of_row [M] int32 (row_map // K: kernels.sort_rows
    returns it), inverse [M] int64 -> h [M, 2I] in x.dtype."""
    return GatherFC1.apply(x, w1, offs, token_of_row, inverse, topk, gemm)
