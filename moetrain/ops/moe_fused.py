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
On trial (moe_experts(swiglu_fusion=...)): ``fc1_swiglu_gathered`` ("fc1") is the "gather" forward with SwiGLU
in its epilogue (kernels.fc1_swiglu), returning a [M, I] instead of h, same backward after SwiGLU's;
``swiglu_fc2`` ("fc2") is SwiGLU and FC2 with SwiGLU's backward in FC2's data gradient
(kernels.fc2_dgrad_swiglu); "both" feeds it h and a from ``fc1_swiglu_pair``.
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
    """h = grouped_gemm(x[row_map // K], w1, offs) without materializing x[row_map // K]."""

    @staticmethod
    def forward(ctx, x, w1, offs, row_map, inverse, topk, gemm):
        offs, token_of_row = _int32_rows(offs, row_map, topk)
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
        dx, dw1 = _saved_fc1_grads(ctx, dh)
        return dx, dw1, None, None, None, None, None


def _int32_rows(offs, row_map, topk: int):
    """(offs [E] int32, token_of_row [M] int32 = row_map // K): what the gathered FC1 kernels read."""
    return offs.to(torch.int32), (row_map // topk).to(torch.int32)


def _saved_fc1_grads(ctx, dh):
    """_fc1_grads from what GatherFC1 and GatherFC1Pair save (x, w1, offs, inverse, token_of_row)."""
    x, w1, offs, inverse, token_of_row = ctx.saved_tensors
    return _fc1_grads(ctx.needs_input_grad[0], ctx.needs_input_grad[1], dh, x, w1, offs, inverse, token_of_row,
                      ctx.topk, ctx.gemm)


def _fc1_grads(needs_x: bool, needs_w: bool, dh, x, w1, offs, inverse, token_of_row, topk: int, gemm: str):
    """(dx [T, H] or None, dw1 [E, 2I, H] or None) of h = x[token_of_row] @ w1_g^T given dh [M, 2I]."""
    dh = dh.to(x.dtype).contiguous()
    dx = dw1 = None
    if needs_x:
        dx_perm = grouped_gemm_op("dgrad", gemm, dh, w1, offs, w1.shape)
        dx = combine(dx_perm, inverse, None, topk, "triton")
    if needs_w:
        variant = "copy"
        if gemm == "auto":
            G, N, K = w1.shape
            variant = autoselect.choose("moe_fc1_wgrad", dh, N, K, dh.shape[0], G,
                                        lambda name: _fc1_wgrad(name, "auto", dh, x, offs, token_of_row, w1.shape))
        dw1 = _fc1_wgrad(variant, gemm, dh, x, offs, token_of_row, w1.shape)
    return dx, dw1


class GatherFC1SwiGLU(torch.autograd.Function):
    """a = act(x[row_map // K] @ w1_g^T) * probs[:, None] with FC1 and SwiGLU in one kernel (kernels.fc1_swiglu):
    the pre-activation h is written once and read only by the backward (which is GatherFC1's after SwiGLU's).
    Keeps what GatherFC1 and the separate SwiGLU keep together (x, routing, h, probs), but h as ``ctx.h``, dropped
    as soon as SwiGLU's backward has read it: saved for backward, it would live through FC1's weight gradient
    too (+1.9 GB of peak at Mixtral, call H of session 7), where the separate SwiGLU node has released it."""

    @staticmethod
    def forward(ctx, x, w1, offs, row_map, inverse, topk, probs, activation, gemm):
        from moetrain.kernels.fc1_swiglu import fc1_swiglu  # imports triton: only on this path

        offs, token_of_row = _int32_rows(offs, row_map, topk)
        h, a = fc1_swiglu(x, w1, offs, activation, probs, gather_rows=token_of_row)
        ctx.save_for_backward(x, w1, offs, inverse, token_of_row, probs)
        ctx.h = h  # an intermediate, not an input or output: no reference cycle
        ctx.topk, ctx.gemm, ctx.activation = topk, gemm, activation
        return a

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, da):
        from moetrain.kernels.moe_rows import swiglu_bwd

        x, w1, offs, inverse, token_of_row, probs = ctx.saved_tensors
        h, ctx.h = ctx.h, None
        dh, dprobs = swiglu_bwd(h, da.to(h.dtype).contiguous(), ctx.activation, probs)
        del h, da
        dx, dw1 = _fc1_grads(ctx.needs_input_grad[0], ctx.needs_input_grad[1], dh, x, w1, offs, inverse,
                             token_of_row, ctx.topk, ctx.gemm)
        return dx, dw1, None, None, None, None, dprobs if ctx.needs_input_grad[6] else None, None, None


class GatherFC1Pair(torch.autograd.Function):
    """(h, a): FC1 with SwiGLU in its epilogue for SwiGLUFC2 (swiglu_fusion "both"). h is differentiable, a is
    not: SwiGLUFC2's backward gives h and probs their gradients through SwiGLU itself. Saves what GatherFC1 saves."""

    @staticmethod
    def forward(ctx, x, w1, offs, row_map, inverse, topk, probs, activation, gemm):
        from moetrain.kernels.fc1_swiglu import fc1_swiglu

        offs, token_of_row = _int32_rows(offs, row_map, topk)
        h, a = fc1_swiglu(x, w1, offs, activation, probs, gather_rows=token_of_row)
        ctx.save_for_backward(x, w1, offs, inverse, token_of_row)
        ctx.topk, ctx.gemm = topk, gemm
        ctx.mark_non_differentiable(a)
        return h, a

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh, _da):
        dx, dw1 = _saved_fc1_grads(ctx, dh)
        return dx, dw1, None, None, None, None, None, None, None


class SwiGLUFC2(torch.autograd.Function):
    """y [M, H] = (act(h) * probs[:, None]) @ w2_g^T with SwiGLU's backward in FC2's data gradient
    (kernels.fc2_dgrad_swiglu: da never stored). ``a`` = act(h) * probs when the caller has it already (FC1's
    fused epilogue), else None (computed here). Saves h, a and probs, what the separate SwiGLU and FC2 save."""

    @staticmethod
    def forward(ctx, h, a, probs, w2, offs, activation, gemm):
        if a is None:
            from moetrain.kernels.moe_rows import swiglu_fwd

            a = swiglu_fwd(h, activation, probs)
        offs = offs.to(torch.int32)
        ctx.save_for_backward(h, a, probs, w2, offs)
        ctx.activation, ctx.gemm = activation, gemm
        return grouped_gemm_op("fwd", gemm, a, w2, offs, w2.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        from moetrain.kernels.fc2_dgrad_swiglu import fc2_dgrad_swiglu

        h, a, probs, w2, offs = ctx.saved_tensors
        dy = dy.to(h.dtype).contiguous()
        dh = dprobs = dw2 = None
        # the weight gradient first: then dh [M, 2I] is not allocated beside dw2 (the separate kernels' peak)
        if ctx.needs_input_grad[3]:
            dw2 = grouped_gemm_op("wgrad", ctx.gemm, dy, a, offs, w2.shape)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            dh, dprobs = fc2_dgrad_swiglu(dy, w2, offs, h, ctx.activation, probs)
        return dh, None, dprobs if ctx.needs_input_grad[2] else None, dw2, None, None, None


def swiglu_fc2(h, w2, offs, probs, activation: str = "swiglu", gemm: str = "triton", a=None) -> torch.Tensor:
    """h [M, 2I], w2 [E, H, I], offs [E] int32, probs [M] fp32 or None (a [M, I] = act(h) * probs if known) ->
    y [M, H] = a @ w2_g^T, SwiGLU's backward fused into FC2's data gradient; ``gemm`` picks FC2's forward and
    weight gradient as grouped_gemm_op does."""
    return SwiGLUFC2.apply(h, a, probs, w2, offs, activation, gemm)


def fc1_swiglu_pair(x, w1, offs, row_map, inverse, topk: int, probs, activation: str = "swiglu",
                    gemm: str = "triton"):
    """(h [M, 2I], a [M, I]) from FC1 with SwiGLU in its epilogue, for ``swiglu_fc2(h, ..., a=a)``."""
    return GatherFC1Pair.apply(x, w1, offs, row_map, inverse, topk, probs, activation, gemm)


def fc1_swiglu_gathered(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, row_map: torch.Tensor,
                        inverse: torch.Tensor, topk: int, probs: torch.Tensor | None, activation: str = "swiglu",
                        gemm: str = "triton") -> torch.Tensor:
    """x [T, H], w1 [E, 2I, H], offs [E] int32, row_map / inverse [M] int64, probs [M] fp32 or None ->
    a [M, I] in x.dtype = act(h) * probs with h = x[row_map // K] @ w1_g^T (FC1 and SwiGLU fused; ``gemm``
    picks the backward's GEMMs as in fc1_gathered)."""
    return GatherFC1SwiGLU.apply(x, w1, offs, row_map, inverse, topk, probs, activation, gemm)


def fc1_gathered(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, row_map: torch.Tensor,
                 inverse: torch.Tensor, topk: int, gemm: str = "triton") -> torch.Tensor:
    """x [T, H], w1 [E, 2I, H], offs [E] int32, row_map / inverse [M] int64 -> h [M, 2I] in x.dtype."""
    return GatherFC1.apply(x, w1, offs, row_map, inverse, topk, gemm)
