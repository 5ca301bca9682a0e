"""Row ops of the expert path, with autograd: the weighted top-k combine, the sum over top-k (the
data gradient of the token gather), and SwiGLU.

Legend: T tokens, K top-k, M = T*K routed rows (sorted by expert), H hidden, I expert intermediate.
``inverse [M]`` int64: the permuted row holding flat assignment a = t*K + k (``inverse_permutation``).

Each op has two implementations, picked by ``impl``:
  "torch"  : plain PyTorch (gathers and reductions; no atomics). The reference, and what the torch
             and loop backends run; needs no triton.
  "triton" : moetrain.kernels.moe_rows, one kernel per op and direction (fp32 accumulation).
Both keep the reduction over K inside one owner per token: deterministic and sync-free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# GPT-OSS's clamped SwiGLU constants (the Triton kernel spells them as literals).
CLAMPED_ALPHA = 1.702
CLAMPED_LIMIT = 7.0
ROW_IMPLS = ("torch", "triton")


def inverse_permutation(row_map: torch.Tensor, assignments: int | None = None) -> torch.Tensor:
    """inverse [A] int64: inverse[a] = the permuted row that holds flat assignment a (row_map[inverse[a]] = a).

    row_map [M'] may hold -1 for padding rows (``permute`` with align > 1); then pass the number of
    assignments A = T*K. Padding rows land in a spare slot past A (sync-free: no boolean indexing)."""
    n = row_map.numel() if assignments is None else assignments
    target = row_map if assignments is None else torch.where(row_map < 0, torch.full_like(row_map, n), row_map)
    inverse = torch.empty(n + (assignments is not None), dtype=row_map.dtype, device=row_map.device)
    inverse[target] = torch.arange(row_map.numel(), device=row_map.device)
    return inverse[:n]


def swiglu_torch(h: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """h [M, 2I] (columns 0..I-1 gate, I..2I-1 up) -> [M, I], dtype of h.

    swiglu: silu(gate) * up.
    swiglu_clamped (GPT-OSS): gate clamped above at 7, up clamped to [-7, 7],
    gate * sigmoid(1.702 * gate) * (up + 1).
    """
    gate, up = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "swiglu_clamped":
        gate = gate.clamp(max=CLAMPED_LIMIT)
        up = up.clamp(min=-CLAMPED_LIMIT, max=CLAMPED_LIMIT)
        return gate * torch.sigmoid(CLAMPED_ALPHA * gate) * (up + 1)
    raise ValueError(f"unknown expert activation {activation!r}; valid: swiglu, swiglu_clamped")


def swiglu_bwd_torch(h: torch.Tensor, da: torch.Tensor, activation: str) -> torch.Tensor:
    """dh [M, 2I] from h [M, 2I] and da [M, I] (autograd of ``swiglu_torch``)."""
    with torch.enable_grad():
        leaf = h.detach().requires_grad_()
        (dh,) = torch.autograd.grad(swiglu_torch(leaf, activation), leaf, da)
    return dh


def combine_torch(y: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor | None, topk: int) -> torch.Tensor:
    """out [T, H] = sum_k weight[t, k] * y[inverse[t*K + k]] (weight None: 1), y's dtype.

    The weighted sum is a batched [1, K] x [K, H] product (fp32 accumulation inside the GEMM; the
    weights rounded to y's dtype, as a 16-bit layer would)."""
    rows = y.index_select(0, inverse).view(-1, topk, y.shape[1])
    if weight is None:
        return rows.sum(dim=1)
    return torch.bmm(weight.to(y.dtype).unsqueeze(1), rows).squeeze(1)


def combine_bwd_torch(dout: torch.Tensor, y: torch.Tensor | None, inverse: torch.Tensor,
                      weight: torch.Tensor | None, rows: int):
    """(dy [rows, H] in dout's dtype, dweight [T, K] in weight's dtype or None) of ``combine_torch``;
    y is needed only with a weight; rows of y that no assignment reads (padding) get zero."""
    tokens, H = dout.shape
    topk = inverse.shape[0] // max(tokens, 1)
    g = dout.unsqueeze(1).expand(tokens, topk, H)
    dweight = None
    if weight is not None:
        picked = y.index_select(0, inverse).view(tokens, topk, H)
        dweight = torch.bmm(picked, dout.unsqueeze(-1)).squeeze(-1).to(weight.dtype)
        g = g * weight.to(dout.dtype).unsqueeze(-1)
    dy = dout.new_zeros(rows, H) if rows > inverse.numel() else dout.new_empty(rows, H)
    dy[inverse] = g.reshape(tokens * topk, H)
    return dy, dweight


def row_kernels():
    """moetrain.kernels.moe_rows, imported on first use: it imports triton, needed only by the triton implementation
    (here and on the fused path, ops/moe_fused.py)."""
    from moetrain.kernels import moe_rows

    return moe_rows


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inverse, weight, topk, impl):
        ctx.save_for_backward(y if weight is not None else None, inverse, weight)
        ctx.impl, ctx.rows = impl, y.shape[0]
        if impl == "triton":
            return row_kernels().combine(y, inverse, weight, topk)
        return combine_torch(y, inverse, weight, topk)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        y, inverse, weight = ctx.saved_tensors  # y is None without a weight: the gradient is a gather
        if ctx.impl == "triton":
            dy, dweight = row_kernels().combine_bwd(dout, y, inverse, weight, ctx.rows)
        else:
            dy, dweight = combine_bwd_torch(dout, y, inverse, weight, ctx.rows)
        return dy, None, dweight if ctx.needs_input_grad[2] else None, None, None


def combine(y: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor | None, topk: int,
            impl: str = "torch") -> torch.Tensor:
    """out [T, H] = sum_k weight[t, k] * y[inverse[t*K + k]], y's dtype (fp32 accumulation).

    y [M', H] rows in permuted order (M' >= M = T*K: rows no assignment reads, e.g. padding, are
    ignored and get zero gradient); inverse [M] int64; weight [T, K] float32 (zero for a dropped
    assignment) or None for a plain sum over the K rows of each token. Differentiable in y and weight."""
    return _Combine.apply(y, inverse, weight, topk, _impl(impl))


class _ExpandRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_map, inverse, topk):
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return x.index_select(0, row_map // topk)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dx_perm):
        (inverse,) = ctx.saved_tensors
        return combine_torch(dx_perm, inverse, None, ctx.topk), None, None, None  # x_perm has M rows


def expand_rows(x: torch.Tensor, row_map: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
    """x_perm [M, H] = x[row_map // K] (the permuted copy of the token rows x [T, H]). Its gradient
    is the sum over each token's K rows, a gather (``combine`` without weights), not an index_add."""
    return _ExpandRows.apply(x, row_map, inverse, topk)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, probs, activation, impl):
        ctx.save_for_backward(h, probs)
        ctx.activation, ctx.impl = activation, impl
        if impl == "triton":
            return row_kernels().swiglu_fwd(h, activation, probs)
        a = swiglu_torch(h, activation)
        return a if probs is None else (a * probs.unsqueeze(1)).to(a.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, da):
        return swiglu_backward(ctx, da)


def swiglu_backward(ctx, da):
    """(dh, dprobs or None, None, None) of a SwiGLU node whose ctx saved (h, probs) and holds activation and impl
    (_SwiGLU here; moe_fused's node for the a that FC1's fused kernel computed)."""
    h, probs = ctx.saved_tensors
    da = da.to(h.dtype)
    if ctx.impl == "triton":
        dh, dprobs = row_kernels().swiglu_bwd(h, da, ctx.activation, probs)
    else:
        dprobs = None if probs is None else (da * swiglu_torch(h, ctx.activation)).sum(dim=1, dtype=probs.dtype)
        dh = swiglu_bwd_torch(h, da if probs is None else (da * probs.unsqueeze(1)).to(h.dtype), ctx.activation)
    return dh, dprobs if ctx.needs_input_grad[1] else None, None, None


def swiglu(h: torch.Tensor, activation: str = "swiglu", impl: str = "torch",
           probs: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, I] = act(h[:, :I], h[:, I:]) for h [M, 2I] (see ``swiglu_torch``), times probs[:, None] when
    given (probs [M]: float32 for impl triton, e.g. routing weights applied before FC2); saves only h
    (and probs). Differentiable in h and probs."""
    if activation not in ("swiglu", "swiglu_clamped"):
        raise ValueError(f"unknown expert activation {activation!r}; valid: swiglu, swiglu_clamped")
    return _SwiGLU.apply(h, probs, activation, _impl(impl))


def _impl(impl: str) -> str:
    if impl not in ROW_IMPLS:
        raise ValueError(f"unknown row-op implementation {impl!r}; valid: {', '.join(ROW_IMPLS)}")
    return impl
