"""Dispatch and combine on one rank: the token rows materialised in expert order, and summed back per token.

Legend: T tokens, H hidden, E experts, K top-k, M = T*K routed rows (sorted by expert).

    rows  [M, H]  = x[token of row r]                   rows of one expert contiguous, experts in id order
    offs  [E]     int32 cumulative group ends           rows offs[e-1]..offs[e]-1 belong to expert e
    probs [M]     fp32 routing weight of row r          0 for a dropped assignment (topk_idx -1)
    inverse [M]   int64: inverse[t*K + k] = the row holding assignment (t, k)

``permute_tokens`` is what an expert-parallel dispatcher sends; ``combine_rows`` is the top-k sum on return.
Dropped assignments sit with the last expert (see ``ops.permute``) and carry probs 0, so their rows add nothing.

impl "triton": the fused path's sort kernel (which also puts the weights in row order) and the row kernels;
"torch": plain PyTorch. Both are sync-free. The gradient of the row gather is the sum over each token's K rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.ops import moe_rows
from moetrain.ops.moe import _SortWithWeights, _live_weight, sort_rows
from moetrain.ops.moe_rows import combine_kernel, token_rows_kernel


@dataclass
class PermutedRows:
    rows: torch.Tensor  # [M, H] x.dtype, rows sorted by expert
    offs: torch.Tensor  # [E] int32 cumulative group ends
    probs: torch.Tensor  # [M] routing weight per row (fp32; topk_weight.dtype with impl torch), differentiable
    inverse: torch.Tensor  # [M] int64 row of each flat assignment t*K + k


class _GatherTokenRows(torch.autograd.Function):
    """rows[inverse[t*K + k]] = x[t] by the Triton row kernel; backward: dx[t] = sum_k drows[inverse[t*K + k]]."""

    @staticmethod
    def forward(ctx, x, inverse, topk):
        ctx.save_for_backward(inverse)
        ctx.topk = topk
        return token_rows_kernel(x, inverse, inverse.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, drows):
        (inverse,) = ctx.saved_tensors
        return combine_kernel(drows.contiguous(), inverse, None, ctx.topk), None, None


def permute_tokens(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, num_experts: int,
                   impl: str = "torch") -> PermutedRows:
    """x [T, H], topk_idx [T, K] int64 (-1 dropped), topk_weight [T, K] float -> PermutedRows (see the module doc).
    Differentiable in x (through rows) and topk_weight (through probs)."""
    K = topk_idx.shape[1]
    if impl == "triton":
        offs, _row_map, inverse, _token_of_row, probs = _SortWithWeights.apply(topk_weight, topk_idx, num_experts)
        return PermutedRows(_GatherTokenRows.apply(x, inverse, K), offs, probs, inverse)
    if impl != "torch":
        raise ValueError(f"permute_tokens: impl {impl!r}; valid: torch, triton")
    offs, row_map = sort_rows(topk_idx, num_experts)
    inverse = moe_rows.inverse_permutation(row_map)
    probs = _live_weight(topk_idx, topk_weight).reshape(-1).index_select(0, row_map)
    return PermutedRows(moe_rows.expand_rows(x, row_map, inverse, K), offs, probs, inverse)


def combine_rows(y: torch.Tensor, inverse: torch.Tensor, topk: int, weight: torch.Tensor | None = None,
                 impl: str = "torch") -> torch.Tensor:
    """out [T, H] = sum_k weight[t, k] * y[inverse[t*K + k]] (weight None: a plain sum, the weights having travelled
    with the rows); y [M, H] -> [T, H] in y's dtype. Differentiable in y and weight."""
    return moe_rows.combine(y, inverse, weight, topk, impl)


def expert_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] int64 expert of each sorted row from the cumulative ends offs [E] (sync-free; rows past offs[-1], if
    any, get E - 1: dropped assignments sit with the last expert)."""
    r = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, r, right=True).clamp(max=offs.shape[0] - 1)
