"""FC1 of the fused expert path: token rows gathered inside the GEMM.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M = T*K routed rows.

    h [M, 2I] = x[token_of_row[r]] @ w1[e(r)]^T     rows r sorted by expert (``permute``'s order)

Forward: our Triton grouped GEMM reads the A rows of x [T, H] through token_of_row = row_map // K,
so the permuted copy x_perm [M, H] is never materialized, and autograd saves x (the layer input,
alive anyway) and the routing instead of x_perm. With gemm "auto", this "gather" forward is measured
once per shape against "copy": x_perm written token by token, fed to the auto-chosen forward GEMM and
freed at once (TMA loads of A and torch's GEMM may beat pointer-gathered loads by more than the
copy costs). Either way autograd keeps the same tensors.
Backward (``gemm`` picks the GEMM backend: "triton", or "auto" = each op's measured winner):
    dx_perm [M, H] = dgrad(dh, w1)                          (grouped GEMM)
    dx[t]          = sum_k dx_perm[inverse[t*K + k]]        (Triton combine without weights: each
                                                            token owns its K rows; no atomics)
    dw1            = wgrad(dh, x_perm)                      "copy": x_perm written again, transiently;
                                                            "gather": our wgrad kernel reads x through
                                                            the index (auto measures both per shape)
Dropped assignments (-1) sit with the last expert (see ``permute``); the combine gives their rows
zero gradient, so they add nothing to dx or dw1.

``fc1_swiglu``: FC1 followed by SwiGLU (with the routing weights as row factors). With gemm "auto" on Hopper it is
measured once per shape as "separate" (the FC1 above, then the SwiGLU kernel, which reads h back) against "fused"
(x_perm written transiently and one ping-pong kernel writing h and a: kernels/rowgroup_pingpong.py); the backward
is the same either way (SwiGLU's backward kernel, then FC1's as above), and so are the saved tensors. Memory: the
fused forward holds x_perm, h and a at once, a [M, I] more than the separate path's "copy" forward, which stays
under the backward's peak: the layer peaks as the separate path does (GPT-OSS 1.15 GiB, Mixtral 2.63:
bench/moe_layer.md; a zero-filled gradient for a would add +0.35 GiB at GPT-OSS: bench/archive/2026-11-30_0001-0108.md).

``fc2_combine``: FC2 and the top-k sum as one autograd node (y = FC2's rows lives only inside the forward; the
backward gathers dout to rows, then FC2's data and weight gradients). One node instead of two: each autograd node
costs the H200's host ~25 us in the forward and ~50 in the backward (`moetrain bench host`), and an eager
layer at a small micro-batch is host-bound. The node boundaries that stay (the sort, FC1, SwiGLU, this) are where
the backward frees memory: a node's saved tensors live until its backward returns (h after SwiGLU's, not FC1's).

torch.compile: FC1's forward, its weight gradient and FC1 + SwiGLU are custom ops (``fc1_fwd``, ``fc1_wgrad``,
``fc1_swiglu``: moetrain.ops.custom_ops) that make their variant choices inside, when they run; the GEMMs and row
kernels around them are custom ops too, so a compiled layer traces the whole fused path. The weight gradients of
FC1 and FC2 may be deferred (moetrain.ops.deferred).
"""

from __future__ import annotations

import torch

from moetrain import tuning
from moetrain.ops import moe_rows
from moetrain.ops.custom_ops import kernel_op
from moetrain.ops.deferred import weight_grad
from moetrain.ops.grouped_gemm import gemm_dgrad, gemm_fwd, gemm_wgrad, grouped_gemm_op
from moetrain.ops.moe_rows import combine_kernel, token_rows_kernel


def _fc1_forward(variant: str, gemm: str, x, w1, offs, token_of_row, inverse):
    """h = x[token_of_row] @ w1_g^T: "gather" reads x through the index in our kernel; "copy" writes
    x_perm token by token (moe_rows.token_rows) and runs the forward GEMM on ``gemm``; x_perm is freed on return."""
    if variant == "gather":
        # imports triton: only on this path
        from moetrain.kernels import grouped_gemm as kernels

        return kernels.grouped_gemm_fwd(x, w1, offs, gather_rows=token_of_row)
    return grouped_gemm_op("fwd", gemm, moe_rows.row_kernels().token_rows(x, inverse), w1, offs)


def _fc1_wgrad(variant: str, gemm: str, dh, x, offs, token_of_row, inverse):
    """dw1 = dh_g^T @ x[token_of_row]_g, the same two variants as ``_fc1_forward``."""
    if variant == "gather":
        from moetrain.kernels import grouped_gemm as kernels

        return kernels.grouped_gemm_wgrad(dh, x, offs, gather_rows=token_of_row)
    return grouped_gemm_op("wgrad", gemm, dh, moe_rows.row_kernels().token_rows(x, inverse), offs)


def _on_both_token_orders(token_of_row, inverse, topk: int, run_one) -> tuple:
    """The tuner's runs for the fused path's variants: run_one(name, token_of_row, inverse) on the caller's rows, and
    on the same routing with its tokens relabeled (runtime.timing.relabeled_tokens, made on the first timed call
    only). A gather through token_of_row is fast where a token's K rows are read close together in time (L2 hits),
    as on the benchmarks' round-robin balanced routing, and slower on a trained router's; timed on the caller's
    first routing alone, the gathers won for that reason at Qwen3 shapes."""
    made = []

    def relabeled(name: str):
        if not made:
            from moetrain.runtime.timing import relabeled_tokens

            made.append(relabeled_tokens(token_of_row, inverse, topk))
        return run_one(name, *made[0])

    return (lambda name: run_one(name, token_of_row, inverse), relabeled)


# The fused path's variants, first the one that runs inside a CUDA graph captured before the tuner measured
# (kernels "gather"/"copy": see the module docstring; "separate"/"fused": fc1_swiglu).
FC1_FWD_VARIANTS = ("gather", "copy")
FC1_WGRAD_VARIANTS = ("copy", "gather")
FC1_SWIGLU_VARIANTS = ("separate", "fused")


# ---- FC1's kernels as custom ops (moetrain.ops.custom_ops); each picks its variant inside, at run time ----------

def _fc1_fwd_fake(x, w1, offs, token_of_row, inverse, topk, gemm):
    return x.new_empty(token_of_row.shape[0], w1.shape[1])


@kernel_op("fc1_fwd", fake=_fc1_fwd_fake)
def fc1_fwd(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, token_of_row: torch.Tensor,
            inverse: torch.Tensor, topk: int, gemm: str) -> torch.Tensor:
    """h [M, 2I] = x[token_of_row] @ w1_g^T: "gather", or with gemm "auto" the measured winner of gather and copy."""
    variant = "gather"
    if gemm == "auto":
        G, N, K = w1.shape
        variant = tuning.choose("moe_fc1_fwd", x, N, K, token_of_row.shape[0], G, FC1_FWD_VARIANTS,
                                _on_both_token_orders(token_of_row, inverse, topk, lambda name, rows, inv: _fc1_forward(
                                    name, "auto", x, w1, offs, rows, inv)), fallback="gather")
    return _fc1_forward(variant, gemm, x, w1, offs, token_of_row, inverse)


def _fc1_wgrad_fake(dh, x, offs, token_of_row, inverse, topk, gemm):
    return dh.new_empty(offs.shape[0], dh.shape[1], x.shape[1])


@kernel_op("fc1_wgrad", fake=_fc1_wgrad_fake)
def fc1_wgrad(dh: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, token_of_row: torch.Tensor,
              inverse: torch.Tensor, topk: int, gemm: str) -> torch.Tensor:
    """dw1 [E, 2I, H] = dh_g^T @ x[token_of_row]_g: "copy", or with gemm "auto" the measured winner of copy and
    gather."""
    variant = "copy"
    if gemm == "auto":
        G, N, K = offs.shape[0], dh.shape[1], x.shape[1]
        variant = tuning.choose("moe_fc1_wgrad", dh, N, K, dh.shape[0], G, FC1_WGRAD_VARIANTS,
                                _on_both_token_orders(token_of_row, inverse, topk, lambda name, rows, inv: _fc1_wgrad(
                                    name, "auto", dh, x, offs, rows, inv)), fallback="copy")
    return _fc1_wgrad(variant, gemm, dh, x, offs, token_of_row, inverse)


def _fc1_swiglu_fake(x, w1, offs, token_of_row, inverse, probs, topk, gemm, activation):
    M, two_i = token_of_row.shape[0], w1.shape[1]
    return x.new_empty(M, two_i), x.new_empty(M, two_i // 2)


@kernel_op("fc1_swiglu", fake=_fc1_swiglu_fake)
def fc1_swiglu_fwd(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, token_of_row: torch.Tensor,
                   inverse: torch.Tensor, probs: torch.Tensor | None, topk: int, gemm: str,
                   activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [M, 2I], a [M, I] = act(h) * probs[:, None]): where the fused kernel applies and gemm is "auto", the
    measured winner of "separate" (``fc1_fwd``, then the SwiGLU kernel) and "fused" (one ping-pong kernel); else
    separate."""
    variant = "separate"
    if gemm == "auto" and fused_fc1_swiglu_applies(x, w1):
        G, N, K = w1.shape

        def run(name, rows, inv):
            if name == "fused":
                return _fused_forward(x, w1, offs, inv, probs, activation)
            return moe_rows.swiglu_fwd_kernel(fc1_fwd(x, w1, offs, rows, inv, topk, gemm), probs, activation)

        variant = tuning.choose("moe_fc1_swiglu", x, N, K, token_of_row.shape[0], G, FC1_SWIGLU_VARIANTS,
                                _on_both_token_orders(token_of_row, inverse, topk, run), fallback="separate")
    if variant == "fused":
        return _fused_forward(x, w1, offs, inverse, probs, activation)
    h = fc1_fwd(x, w1, offs, token_of_row, inverse, topk, gemm)
    return h, moe_rows.swiglu_fwd_kernel(h, probs, activation)


# ---- autograd ---------------------------------------------------------------------------------------------------

class GatherFC1(torch.autograd.Function):
    """h = grouped_gemm(x[token_of_row], w1, offs) without materializing x[token_of_row]."""

    @staticmethod
    def forward(ctx, x, w1, offs, token_of_row, inverse, topk, gemm):
        offs = offs.to(torch.int32)
        _keep_for_fc1_backward(ctx, x, w1, offs, inverse, token_of_row, topk, gemm)
        return fc1_fwd(x, w1, offs, token_of_row, inverse, topk, gemm)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        return _fc1_backward(ctx, dh) + (None,) * 5


def _keep_for_fc1_backward(ctx, x, w1, offs, inverse, token_of_row, topk: int, gemm: str) -> None:
    """What FC1's backward (``_fc1_backward``) reads, saved on an FC1 node (GatherFC1, FusedFC1)."""
    ctx.save_for_backward(x, w1, offs, inverse, token_of_row)
    ctx.topk, ctx.gemm = topk, gemm


def _fc1_backward(ctx, dh) -> tuple:
    """(dx [T, H] or None, dw1 [E, 2I, H] or None) of an FC1 node from dh [M, 2I] (FC1's output gradient); dw1 may
    be deferred (moetrain.ops.deferred: w1 is the node's second tensor argument)."""
    x, w1, offs, inverse, token_of_row = ctx.saved_tensors
    dh = dh.to(x.dtype).contiguous()
    topk, gemm = ctx.topk, ctx.gemm
    dx = dw1 = None
    if ctx.needs_input_grad[0]:
        # dx_perm [M, H] is freed before the weight gradient runs (its "copy" variant gathers another
        # [M, H]): held together, the two would be the layer's peak (DeepSeek-V3: +0.9 GiB,
        # bench/archive/2026-11-29_1835-2000.md)
        dx = combine_kernel(gemm_dgrad(dh, w1, offs, gemm), inverse, None, topk)
    if ctx.needs_input_grad[1]:
        dw1 = weight_grad(ctx, 1, lambda: fc1_wgrad(dh, x, offs, token_of_row, inverse, topk, gemm))
    return dx, dw1


def fc1_gathered(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, token_of_row: torch.Tensor,
                 inverse: torch.Tensor, topk: int, gemm: str = "triton") -> torch.Tensor:
    """x [T, H], w1 [E, 2I, H], offs [E] int32, token_of_row [M] int32 (row_map // K: kernels.sort_rows
    returns it), inverse [M] int64 -> h [M, 2I] in x.dtype."""
    return GatherFC1.apply(x, w1, offs, token_of_row, inverse, topk, gemm)


def fused_fc1_swiglu_applies(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether FC1 with SwiGLU in its epilogue (kernels/rowgroup_pingpong.py) can run: the ping-pong kernels' GPU,
    dtype and triton (grouped_gemm.pingpong_applies), TMA-aligned rows and gate / up halves, and its group limit."""
    from moetrain.kernels import grouped_gemm as kernels

    E, two_i, H = w1.shape
    return (kernels.pingpong_applies(x) and w1.dtype == x.dtype and two_i % 16 == 0 and H % 8 == 0
            and E < 1023)


def _fused_forward(x, w1, offs, inverse, probs, activation: str):
    """(h [M, 2I], a [M, I]) by one kernel from x_perm = x[token_of_row], written here (moe_rows.token_rows) and
    freed on return."""
    from moetrain.kernels.rowgroup_pingpong import grouped_gemm_fc1_swiglu_pingpong

    return grouped_gemm_fc1_swiglu_pingpong(moe_rows.row_kernels().token_rows(x, inverse), w1, offs, probs,
                                            activation)


class FusedFC1(torch.autograd.Function):
    """(h, a) = FC1 of the token rows and a = act(h) * probs[:, None] (``fc1_swiglu_fwd``: one kernel, or FC1 and the
    SwiGLU kernel, as measured). Differentiable in h only, with GatherFC1's backward: a's gradient reaches h through
    ``_SwiGLUOfFusedFC1``, SwiGLU's own node, so that h is freed after SwiGLU's backward as on the separate path
    (held by this node instead, it stayed alive through FC1's backward: +1.9 GB peak at Mixtral)."""

    @staticmethod
    def forward(ctx, x, w1, offs, token_of_row, inverse, probs, topk, gemm, activation):
        offs = offs.to(torch.int32)
        h, a = fc1_swiglu_fwd(x, w1, offs, token_of_row, inverse, probs, topk, gemm, activation)
        _keep_for_fc1_backward(ctx, x, w1, offs, inverse, token_of_row, topk, gemm)
        ctx.mark_non_differentiable(a)
        # a's gradient is never used: materialized, it was a zero-filled [M, I] per backward (0.06-0.28 ms from
        # Qwen3 to Mixtral in profiles)
        ctx.set_materialize_grads(False)
        return h, a

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh, _da):  # (called only when h got a gradient: dh is never None here)
        return _fc1_backward(ctx, dh) + (None,) * 7


class _SwiGLUOfFusedFC1(torch.autograd.Function):
    """The SwiGLU node of the fused path: a (computed by FusedFC1's kernel) as a function of h and probs. Saves and
    differentiates exactly as moe_rows.swiglu with impl "triton" (its backward kernel)."""

    @staticmethod
    def forward(ctx, h, probs, a, activation):
        ctx.save_for_backward(h, probs)
        ctx.activation, ctx.impl = activation, "triton"
        return a.view_as(a)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, da):
        dh, dprobs, _, _ = moe_rows.swiglu_backward(ctx, da)
        return dh, dprobs, None, None


def fc1_swiglu(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, token_of_row: torch.Tensor,
               inverse: torch.Tensor, topk: int, probs: torch.Tensor | None, activation: str,
               gemm: str = "triton") -> torch.Tensor:
    """a [M, I] = act(h[:, :I], h[:, I:]) * probs[:, None] with h = FC1 of the token rows (``fc1_gathered``'s
    operands; probs [M] fp32 or None). With gemm "auto", FusedFC1 and its SwiGLU node, whose forward is measured once
    per shape as "separate" (FC1, then the SwiGLU kernel) against "fused" (one kernel) where the fused kernel applies
    (tuning kind "moe_fc1_swiglu", forward only: both backwards run the same kernels, and the nodes save the same
    tensors either way); otherwise fc1_gathered and the SwiGLU kernel's node."""
    if gemm != "auto":
        return moe_rows.swiglu(fc1_gathered(x, w1, offs, token_of_row, inverse, topk, gemm), activation, "triton",
                               probs=probs)
    h, a = FusedFC1.apply(x, w1, offs, token_of_row, inverse, probs, topk, gemm, activation)
    return _SwiGLUOfFusedFC1.apply(h, probs, a, activation)


class _FC2Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, w2, offs, inverse, topk, gemm):
        ctx.save_for_backward(a, w2, offs, inverse)
        ctx.topk, ctx.gemm = topk, gemm
        return combine_kernel(gemm_fwd(a, w2, offs, gemm), inverse, None, topk)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        a, w2, offs, inverse = ctx.saved_tensors
        gemm = ctx.gemm
        dy = token_rows_kernel(dout.to(a.dtype), inverse, inverse.shape[0])  # dout[token] per row
        da = gemm_dgrad(dy, w2, offs, gemm) if ctx.needs_input_grad[0] else None
        dw2 = weight_grad(ctx, 1, lambda: gemm_wgrad(dy, a, offs, gemm)) if ctx.needs_input_grad[1] else None
        return da, dw2, None, None, None, None


def fc2_combine(a: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor, inverse: torch.Tensor, topk: int,
                gemm: str = "triton") -> torch.Tensor:
    """out [T, H] = sum_k y[inverse[t*K + k]] with y = grouped_gemm(a, w2, offs): a [M, I] rows sorted by expert,
    w2 [E, H, I], offs [E] int32, inverse [M] int64, gemm "triton" or "auto" -> [T, H] in a's dtype. The same
    kernels and numbers as moe_rows.combine(grouped_gemm(a, w2, offs, gemm), inverse, None, topk, "triton"); w2's
    gradient may be deferred (moetrain.ops.deferred)."""
    if a.dim() != 2 or w2.dim() != 3 or a.shape[1] != w2.shape[2] or offs.shape != (w2.shape[0],):
        raise ValueError(f"fc2_combine: a {tuple(a.shape)}, w2 {tuple(w2.shape)}, offs {tuple(offs.shape)} must be "
                         "[M, I], [E, H, I], [E]")
    return _FC2Combine.apply(a, w2, offs.to(torch.int32), inverse, topk, gemm)
