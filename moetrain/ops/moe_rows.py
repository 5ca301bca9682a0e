"""Row ops of the expert path, with autograd: the weighted top-k combine, the sum over top-k (the
data gradient of the token gather), and SwiGLU.

Legend: T tokens, K top-k, M = T*K routed rows (sorted by expert), H hidden, I expert intermediate.
``inverse [M]`` int64: the permuted row holding flat assignment a = t*K + k (``inverse_permutation``).

Each op has two implementations, picked by ``impl``:
  "torch"  : plain PyTorch (gathers and reductions; no atomics). The reference, and what the torch
             and loop backends run; needs no triton.
  "triton" : moetrain.kernels.moe_rows, one kernel per op and direction (fp32 accumulation).
Both keep the reduction over K inside one owner per token: deterministic and sync-free. The Triton kernels are
custom ops (moetrain.ops.custom_ops: ``combine``, ``combine_bwd``, ``token_rows``, ``swiglu_fwd``, ``swiglu_bwd``),
the torch implementation plain PyTorch that torch.compile traces and fuses itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrain.ops.custom_ops import kernel_op

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
    """dh [M, 2I] in h's dtype from h [M, 2I] and da [M, I]: the derivative of ``swiglu_torch`` written out (no
    nested autograd call, so torch.compile traces it), computed in fp32 at least. The clamps pass the gradient
    where their input is inside the limits, ends included (as torch.clamp's backward)."""
    dt = torch.promote_types(h.dtype, torch.float32)
    gate, up = h.to(dt).chunk(2, dim=-1)
    da = da.to(dt)
    if activation == "swiglu":
        s = torch.sigmoid(gate)
        dgate = da * up * s * (1 + gate * (1 - s))
        dup = da * gate * s
    elif activation == "swiglu_clamped":
        g = gate.clamp(max=CLAMPED_LIMIT)
        u = up.clamp(min=-CLAMPED_LIMIT, max=CLAMPED_LIMIT)
        s = torch.sigmoid(CLAMPED_ALPHA * g)
        dgate = (da * (u + 1) * s * (1 + CLAMPED_ALPHA * g * (1 - s))).masked_fill(gate > CLAMPED_LIMIT, 0.0)
        dup = (da * g * s).masked_fill(up.abs() > CLAMPED_LIMIT, 0.0)
    else:
        raise ValueError(f"unknown expert activation {activation!r}; valid: swiglu, swiglu_clamped")
    return torch.cat([dgate, dup], dim=-1).to(h.dtype)


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
    (the custom ops below)."""
    from moetrain.kernels import moe_rows

    return moe_rows


# ---- the Triton row kernels as custom ops (kernels/moe_rows.py documents each) ---------------------------------

@kernel_op("combine", fake=lambda y, inverse, weight, topk: y.new_empty(inverse.shape[0] // topk, y.shape[1]))
def combine_kernel(y: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor | None, topk: int) -> torch.Tensor:
    """out [T, H] = sum_k weight[t, k] * y[inverse[t*K + k]]: y [M', H], inverse [M] int64, weight [T, K] fp32 or
    None (a plain sum) -> y's dtype."""
    return row_kernels().combine(y, inverse, weight, topk)


def _combine_bwd_fake(dout, y, inverse, weight, rows):
    return dout.new_empty(rows, dout.shape[1]), weight.new_empty(weight.shape, dtype=torch.float32)


@kernel_op("combine_bwd", fake=_combine_bwd_fake)
def combine_bwd_kernel(dout: torch.Tensor, y: torch.Tensor, inverse: torch.Tensor, weight: torch.Tensor,
                       rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy [rows, H] in dout's dtype, dweight [T, K] fp32) of the weighted combine from dout [T, H]."""
    return row_kernels().combine_bwd(dout, y, inverse, weight, rows)


@kernel_op("token_rows", fake=lambda x, inverse, rows: x.new_empty(rows, x.shape[1]))
def token_rows_kernel(x: torch.Tensor, inverse: torch.Tensor, rows: int) -> torch.Tensor:
    """x_perm [rows, H]: x_perm[inverse[t*K + k]] = x[t] for x [T, H], inverse [M] int64; rows >= M (rows no
    assignment reads are zero). The plain combine's backward, and the permuted copy of the token rows."""
    return row_kernels().combine_bwd(x, None, inverse, None, rows)[0]


@kernel_op("swiglu_fwd", fake=lambda h, probs, activation: h.new_empty(h.shape[0], h.shape[1] // 2))
def swiglu_fwd_kernel(h: torch.Tensor, probs: torch.Tensor | None, activation: str) -> torch.Tensor:
    """a [M, I] = act(h) (* probs[:, None]) for h [M, 2I], probs [M] fp32 or None -> h's dtype."""
    return row_kernels().swiglu_fwd(h, activation, probs)


def _swiglu_bwd_fake(h, da, probs, activation):
    return [h.new_empty(h.shape)] + ([] if probs is None else [probs.new_empty(h.shape[0])])


@kernel_op("swiglu_bwd", fake=_swiglu_bwd_fake)
def swiglu_bwd_kernel(h: torch.Tensor, da: torch.Tensor, probs: torch.Tensor | None,
                      activation: str) -> list[torch.Tensor]:
    """[dh [M, 2I] in h's dtype] from da [M, I], and dprobs [M] fp32 after it when probs is given."""
    dh, dprobs = row_kernels().swiglu_bwd(h, da, activation, probs)
    return [dh] if dprobs is None else [dh, dprobs]


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inverse, weight, topk, impl):
        ctx.save_for_backward(y if weight is not None else None, inverse, weight)
        ctx.impl, ctx.rows = impl, y.shape[0]
        if impl == "triton":
            return combine_kernel(y, inverse, weight, topk)
        return combine_torch(y, inverse, weight, topk)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        y, inverse, weight = ctx.saved_tensors  # y is None without a weight: the gradient is a gather
        if ctx.impl == "triton" and weight is None:
            dy, dweight = token_rows_kernel(dout, inverse, ctx.rows), None
        elif ctx.impl == "triton":
            dy, dweight = combine_bwd_kernel(dout, y, inverse, weight, ctx.rows)
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
            return swiglu_fwd_kernel(h, probs, activation)
        a = swiglu_torch(h, activation)
        if probs is None:
            return a
        scaled = a * probs.unsqueeze(1)
        # no cast when the dtypes agree: a no-op .to() returned from a Function's forward gave wrong gradients
        # under torch.compile in torch 2.11 (tests/unit/test_compile.py's unfused layers)
        return scaled if scaled.dtype == a.dtype else scaled.to(a.dtype)

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
        dh, *dprobs = swiglu_bwd_kernel(h, da, probs, ctx.activation)
        dprobs = dprobs[0] if dprobs else None
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
