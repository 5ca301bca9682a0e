"""The expert path of an MoE layer: permute -> FC1 -> SwiGLU -> FC2 -> weighted combine.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M = T*K routed rows.

Backends:
  "triton" : the fused path. The rows are sorted by expert with one Triton kernel pair
             (kernels/sort_rows.py), FC1 reads token rows through an index inside the GEMM (no permuted
             copy of x; moe_fused.py), SwiGLU and the combine are one Triton kernel per direction
             (moe_rows.py), every GEMM is our Triton grouped GEMM. Without FC2 biases the routing
             weights scale SwiGLU's output rows (FC2 is linear) and the combine is a plain sum, so
             FC2's output rows are not kept for the weights' gradient.
  "auto"   : on CUDA with 16-bit activations, the fused path with each of the other five GEMMs
             (FC1 data and weight gradients, FC2 forward, data and weight gradients) on the backend
             measured fastest for it (grouped_gemm's per-op "auto"), and FC1's forward measured as
             gather vs copy, and FC1 + SwiGLU as separate kernels vs one fused ping-pong kernel on Hopper
             (moe_fused.py); on CUDA in fp32, "torch" (our kernels are tuned for 16-bit
             tiles; fp32 autotuning took minutes per shape); elsewhere "loop".
  "torch"  : torch._grouped_mm GEMMs and plain-PyTorch row ops (no triton needed).
  "loop"   : the per-expert reference ("reference" in the config).

Sync-free: token counts and offsets stay on the device; no host reads depend on routing
(the "loop" grouped GEMM backend is the exception: it is the reference).

torch.compile: every backend but "loop" traces whole (fullgraph): the kernels are custom ops with fake
implementations (moetrain.ops.custom_ops), their run-time choices made inside them, and the torch
backend's row ops plain PyTorch. "loop" reads the group offsets on the host: a graph break.
"""

from __future__ import annotations

import torch

from moetrain.ops import moe_rows
from moetrain.ops.custom_ops import kernel_op
from moetrain.ops.grouped_gemm import grouped_gemm, require_triton
from moetrain.ops.moe_fused import fc1_gathered, fc1_swiglu, fc2_combine
from moetrain.ops.moe_rows import (  # noqa: F401 (CLAMPED_ALPHA, CLAMPED_LIMIT: public here too)
    CLAMPED_ALPHA,
    CLAMPED_LIMIT,
    inverse_permutation,
    swiglu_torch,
)
from moetrain.runtime.expert_plan import plan_for


def swiglu(h: torch.Tensor, activation: str = "swiglu", probs: torch.Tensor | None = None,
           impl: str = "torch") -> torch.Tensor:
    """a [M, I] = act(h[:, :I], h[:, I:]) for h [..., 2I] (see ``moe_rows.swiglu_torch``), times probs[:, None]
    when probs [M] is given (routing weights applied before FC2). With impl "torch" and no probs this is
    the plain PyTorch composition (autograd keeps its parts: what the dense MLP and the planner assume);
    otherwise the op of ``moe_rows.swiglu`` (saves only h; impl "triton": one kernel per direction)."""
    if probs is None and impl == "torch":
        return swiglu_torch(h, activation)
    return moe_rows.swiglu(h, activation, impl, probs=probs)


def permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, align: int = 1):
    """Group the routed copies of each token by expert.

    x [T, H]; topk_idx [T, K] int64 with -1 marking a dropped assignment.
    Returns (x_perm [M', H] rows sorted by expert, offs [E] int32 cumulative group ends,
             row_map [M'] int64: x_perm row r is the copy for flat assignment row_map[r] = t*K + k).
    Dropped assignments are grouped with the last expert: every row then holds a finite
    expert output, which the combine multiplies by zero. That costs compute only when tokens
    are actually dropped, and keeps the combine free of masks and host syncs.
    align > 1 pads every group to a multiple of ``align`` rows (block-scaled FP8 GEMMs need it):
    padding rows are zero with row_map -1, and M' = M + E * (align - 1), the most padding can take
    (a size known without reading the counts; rows past offs[-1] belong to no group).
    """
    offs, row_map = sort_rows(topk_idx, num_experts)
    K = topk_idx.shape[1]
    if align == 1:
        return x.index_select(0, row_map // K), offs, row_map
    if align < 1:
        raise ValueError(f"permute: align={align} must be >= 1")
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
    padded = (counts + align - 1) // align * align
    padded_offs = torch.cumsum(padded, 0)
    M = row_map.numel()
    expert = _grouping_key(topk_idx.reshape(-1), num_experts).index_select(0, row_map)
    position = torch.arange(M, device=x.device) - (offs.long() - counts)[expert] + (padded_offs - padded)[expert]
    rows = M + num_experts * (align - 1)
    x_perm = x.new_zeros(rows, x.shape[1]).index_copy_(0, position, x.index_select(0, row_map // K))
    padded_map = torch.full((rows,), -1, dtype=row_map.dtype, device=x.device).index_copy_(0, position, row_map)
    return x_perm, padded_offs.to(torch.int32), padded_map


def sort_rows(topk_idx: torch.Tensor, num_experts: int):
    """The routing half of ``permute``: (offs [E] int32, row_map [M] int64), no copy of x (plain PyTorch; the
    fused path sorts with moetrain.kernels.sort_rows, which also returns the inverse and each row's token)."""
    key = _grouping_key(topk_idx.reshape(-1), num_experts)
    # A narrow key: the GPU's radix sort makes one pass per key byte (same stable order either way).
    narrow = torch.int16 if num_experts <= 2**15 else torch.int32
    row_map = torch.argsort(key.to(narrow), stable=True)
    # scatter_add rather than bincount: bincount sizes its output from the data (a device sync); an id >= E
    # fails here (index out of bounds) instead of falling past the last group.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts, dim=0).to(torch.int32)
    return offs, row_map


def unpermute(y_perm: torch.Tensor, row_map: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor):
    """Combine: out[t] = sum_k topk_weight[t, k] * y[t*K + k], dropped assignments (-1) excluded.

    y_perm [M', H] in permuted order; row_map [M'] from ``permute`` (-1: a padding row, ignored);
    topk_idx/topk_weight [T, K]. Returns [T, H] in the dtype of y_perm (plain PyTorch, no atomics;
    see ``moe_rows.combine``).
    """
    return moe_rows.combine(y_perm, inverse_permutation(row_map, topk_idx.numel()),
                            _live_weight(topk_idx, topk_weight), topk_idx.shape[1])


def moe_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "swiglu",
    backend: str = "auto",
) -> torch.Tensor:
    """sum_k topk_weight[t, k] * FFN_{topk_idx[t, k]}(x[t]) for every token t.

    x [T, H]; topk_idx [T, K] int64 (-1 = dropped); topk_weight [T, K] fp32;
    w1 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up); w2 [E, H, I]; b1 [E, 2I]; b2 [E, H].
    FFN_e(x) = w2[e] @ act(w1[e] @ x + b1[e]) + b2[e]. Returns [T, H] in x.dtype.

    See the module docstring for the backends; every one is sync-free except "loop".
    """
    _check_operands(x, topk_idx, topk_weight, w1, w2, b1, b2)
    gemm = expert_gemm_backend(backend, x)
    return _moe_experts(x, topk_idx, topk_weight, w1, w2, b1, b2, activation, gemm)


def expert_gemm_backend(backend: str, x: torch.Tensor) -> str:
    """The GEMM backend the expert path runs for moe.backend ``backend`` and activations x: "triton" or "auto" (the
    fused path's kernels), "torch" or "loop" (runtime.expert_plan's rule; see the module docstring)."""
    gemm = plan_for(x, backend).gemm
    if gemm == "triton":
        require_triton(x.device)
    return gemm


def _check_operands(x, topk_idx, topk_weight, w1, w2, b1, b2) -> None:
    """Shapes and the routing's dtype, on the host (no device reads): a mismatch is one line naming both sides
    instead of an error from inside a kernel."""
    if x.dim() != 2 or topk_idx.dim() != 2:
        raise ValueError(f"moe_experts: x {tuple(x.shape)} must be [T, H] and topk_idx {tuple(topk_idx.shape)} [T, K]")
    if topk_idx.shape != topk_weight.shape or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts: topk_idx {tuple(topk_idx.shape)} / topk_weight {tuple(topk_weight.shape)} "
            f"must both be [T, K] with T = {x.shape[0]}")
    if topk_idx.dtype != torch.int64:
        raise ValueError(f"moe_experts: topk_idx must hold int64 expert ids (as ops.route returns), got {topk_idx.dtype}")
    H = x.shape[1]
    if w1.dim() != 3 or w1.shape[2] != H or w1.shape[1] % 2:
        raise ValueError(f"moe_experts: w1 {tuple(w1.shape)} must be [E, 2I, H] with H = {H} (x's columns)")
    E, I = w1.shape[0], w1.shape[1] // 2  # (I: the legend's name)
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"moe_experts: w2 {tuple(w2.shape)} must be [E, H, I] = {(E, H, I)} to match w1 "
                         f"{tuple(w1.shape)} and x {tuple(x.shape)}")
    for name, b, want in (("b1", b1, (E, 2 * I)), ("b2", b2, (E, H))):
        if b is not None and tuple(b.shape) != want:
            raise ValueError(f"moe_experts: {name} {tuple(b.shape)} must be {want}")


def _moe_experts(x, topk_idx, topk_weight, w1, w2, b1, b2, activation: str, gemm: str) -> torch.Tensor:
    """moe_experts with a resolved backend ``gemm``: triton / auto (the fused path), torch or loop."""
    E, K = w1.shape[0], topk_idx.shape[1]
    fused = gemm in ("triton", "auto")
    rows = "triton" if fused else "torch"
    if fused and b2 is None:
        # The routing weights scale the rows inside SwiGLU, before FC2 (FC2 is linear): the combine is
        # then a plain sum and keeps no copy of FC2's output [M, H] for the weights' gradient, which
        # SwiGLU's backward gets from the [M, I] values it reads anyway. (With an FC2 bias the scaled
        # bias would keep an [M, H] operand instead: the weights stay in the combine.) The sort puts the
        # weights in row order itself (probs [M] fp32).
        offs, row_map, inverse, token_of_row, probs = _SortWithWeights.apply(topk_weight, topk_idx, E)
    elif fused:  # one Triton sort with the inverse and each row's token (the PyTorch ops were ~20 launches)
        offs, row_map, inverse, token_of_row = sort_rows_kernel(topk_idx, None, E)
    else:
        offs, row_map = sort_rows(topk_idx, E)
        inverse = inverse_permutation(row_map)
    if b1 is not None or b2 is not None:
        expert_of_row = _expert_of_row(topk_idx, row_map, E)
    if fused and b2 is None:
        if b1 is None:
            a = fc1_swiglu(x, w1, offs, token_of_row, inverse, K, probs, activation, gemm)
        else:  # FC1's bias is added to h between FC1 and SwiGLU
            h = fc1_gathered(x, w1, offs, token_of_row, inverse, K, gemm) + b1.index_select(0, expert_of_row)
            a = moe_rows.swiglu(h, activation, rows, probs=probs)
        return fc2_combine(a, w2, offs, inverse, K, gemm)
    if fused:
        h = fc1_gathered(x, w1, offs, token_of_row, inverse, K, gemm)
    else:
        h = grouped_gemm(moe_rows.expand_rows(x, row_map, inverse, K), w1, offs, gemm)
    if b1 is not None:
        h = h + b1.index_select(0, expert_of_row)
    weight = _live_weight(topk_idx, topk_weight)
    if fused:
        weight = weight.float()  # the Triton combine takes fp32 weights
    a = moe_rows.swiglu(h, activation, rows)
    y = grouped_gemm(a, w2, offs, gemm)
    if b2 is not None:
        y = y + b2.index_select(0, expert_of_row)
    return moe_rows.combine(y, inverse, weight, K, rows)


def _sort_rows_fake(topk_idx, weights, num_experts):
    M = topk_idx.numel()
    out = [topk_idx.new_empty(num_experts, dtype=torch.int32), topk_idx.new_empty(M), topk_idx.new_empty(M),
           topk_idx.new_empty(M, dtype=torch.int32)]
    return out if weights is None else out + [topk_idx.new_empty(M, dtype=torch.float32)]


@kernel_op("sort_rows", fake=_sort_rows_fake)
def sort_rows_kernel(topk_idx: torch.Tensor, weights: torch.Tensor | None, num_experts: int) -> list[torch.Tensor]:
    """The fused path's row sort (kernels/sort_rows.py) as a custom op: [offs [E] int32, row_map [M] int64,
    inverse [M] int64, token_of_row [M] int32] of topk_idx [T, K] int64, and probs [M] fp32 after them when the
    routing weights [T, K] are given."""
    from moetrain.kernels import sort_rows as sorting

    return list(sorting.sort_rows(topk_idx, num_experts, weights=weights))


@kernel_op("routing_weight_grad", fake=lambda dprobs, inverse, topk_idx, dtype: dprobs.new_empty(topk_idx.shape,
                                                                                                 dtype=dtype))
def routing_weight_grad_kernel(dprobs: torch.Tensor, inverse: torch.Tensor, topk_idx: torch.Tensor,
                               dtype: torch.dtype) -> torch.Tensor:
    """dweights [T, K] in ``dtype`` from dprobs [M] fp32: the backward of sort_rows' probs (kernels/sort_rows.py)."""
    from moetrain.kernels import sort_rows as sorting

    return sorting.routing_weight_grad(dprobs, inverse, topk_idx, dtype)


class _SortWithWeights(torch.autograd.Function):
    """The fused path's row sort (kernels/sort_rows.py) with the routing weights carried into row order:
    (offs, row_map, inverse, token_of_row, probs [M] fp32), probs[r] = topk_weight.flat[row_map[r]] and 0 for a
    dropped assignment. Differentiable in topk_weight through probs (one gather kernel back)."""

    @staticmethod
    def forward(ctx, topk_weight, topk_idx, num_experts):
        offs, row_map, inverse, token_of_row, probs = sort_rows_kernel(topk_idx, topk_weight, num_experts)
        ctx.save_for_backward(inverse, topk_idx)
        ctx.weight_dtype = topk_weight.dtype
        ctx.mark_non_differentiable(offs, row_map, inverse, token_of_row)
        # no zero-filled gradients for the four index outputs: each would be a kernel and ~50 us of host time
        ctx.set_materialize_grads(False)
        return offs, row_map, inverse, token_of_row, probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _offs, _row_map, _inverse, _token_of_row, dprobs):
        if dprobs is None or not ctx.needs_input_grad[0]:
            return None, None, None
        inverse, topk_idx = ctx.saved_tensors
        return routing_weight_grad_kernel(dprobs.float(), inverse, topk_idx, ctx.weight_dtype), None, None


def _live_weight(topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """topk_weight with dropped assignments (-1) zeroed: their rows add nothing and get no gradient."""
    return topk_weight.masked_fill(topk_idx < 0, 0.0)


def _grouping_key(flat_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The group of each assignment: its expert, or the last expert for a dropped one (-1)."""
    return torch.where(flat_idx < 0, num_experts - 1, flat_idx)


def _expert_of_row(topk_idx: torch.Tensor, row_map: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert id of each permuted row; dropped rows sit with the last expert (see ``permute``)."""
    return _grouping_key(topk_idx.reshape(-1).index_select(0, row_map), num_experts)
