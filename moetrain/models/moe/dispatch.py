"""Dispatchers: how routed token rows reach the experts and come back (the expert-parallel seam).

Legend: T tokens, H hidden, E experts (E_local on this rank), K top-k, M routed rows.

A dispatcher runs ``dispatch -> experts.compute_rows -> combine``:
  dispatch(x [T, H], topk_idx [T, K], topk_weight [T, K])  -> Dispatched: rows [M, H] sorted by (local) expert,
                                                              offs [E_local] int32 group ends, probs [M] fp32
  experts.compute_rows(rows, offs, probs)                   -> y_rows [M, H] (FC1 -> activation -> FC2)
  combine(y_rows, dispatched)                               -> [T, H] in token order, summed over top-k
An expert-parallel dispatcher sends the rows (and probs) to the rank owning each expert in ``dispatch`` and
brings y_rows back in ``combine``; ``LocalDispatcher`` is the one-rank case.

The routing weights travel with the rows (probs) and scale the activation before FC2, so the combine is a plain
sum: FC2 is linear, the weights' gradient comes from the [M, I] activation that SwiGLU's backward reads anyway,
and no copy of FC2's [M, H] output is kept for it; on the wire they are M floats beside M x H. With FC2 biases the
scaled bias would need that copy: the weights are then applied at the combine instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.ops.dispatch import combine_rows, permute_tokens
from moetrain.runtime.expert_plan import plan_for


@dataclass
class Dispatched:
    rows: torch.Tensor  # [M, H] rows sorted by expert
    offs: torch.Tensor  # [E] int32 cumulative group ends
    probs: torch.Tensor | None  # [M] fp32 routing weight per row; None when the combine applies the weights
    inverse: torch.Tensor  # [M] int64 row of each flat assignment t*K + k
    topk_weight: torch.Tensor | None  # [T, K] weights for the combine (None when they travel with the rows)
    topk: int  # K
    impl: str  # row-op implementation: "torch" | "triton"


def permute_local(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts,
                  num_experts: int) -> Dispatched:
    """This rank's rows sorted by expert id (0..num_experts-1: all experts, global ids under expert parallelism),
    the routing weights as probs, or kept for the combine where FC2 has biases."""
    impl = plan_for(x, experts.backend).rows
    p = permute_tokens(x, topk_idx, topk_weight, num_experts, impl)
    K = topk_idx.shape[1]
    if experts.b2 is None:
        return Dispatched(p.rows, p.offs, p.probs, p.inverse, None, K, impl)
    weight = topk_weight.masked_fill(topk_idx < 0, 0.0)
    weight = weight.float() if impl == "triton" else weight  # the Triton combine takes fp32 weights
    return Dispatched(p.rows, p.offs, None, p.inverse, weight, K, impl)


class Dispatcher:
    """Base class: the unfused composition. Subclasses move rows between ranks in dispatch / combine; ``dispatch``
    returns what ``combine`` needs, with the rows, offs and probs the experts compute on."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts) -> Dispatched:
        return permute_local(x, topk_idx, topk_weight, experts, experts.num_experts)

    def combine(self, y_rows: torch.Tensor, d: Dispatched) -> torch.Tensor:
        return combine_rows(y_rows, d.inverse, d.topk, d.topk_weight, d.impl)

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts) -> torch.Tensor:
        """x [T, H] -> sum_k topk_weight[t, k] * FFN_{topk_idx[t, k]}(x[t]), [T, H] in x.dtype."""
        d = self.dispatch(x, topk_idx, topk_weight, experts)
        return self.combine(experts.compute_rows(d.rows, d.offs, d.probs), d)


class LocalDispatcher(Dispatcher):
    """Expert parallelism 1: every expert is on this rank. ``fused`` (the default) runs the experts' fused path
    (``Experts.forward``: ``ops.moe_experts``, or ``ops.moe_experts_fp8``), which never materialises the 16-bit
    rows (FC1 gathers token rows, FC2 is fused with the combine), where the experts say it runs
    (``Experts.runs_fused``); otherwise the unfused composition of the base class, whose rows are what an
    expert-parallel dispatcher sends."""

    def __init__(self, fused: bool = True):
        self.fused = fused

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts) -> torch.Tensor:
        if self.fused and experts.runs_fused(x):
            return experts(x, topk_idx, topk_weight)
        return super().__call__(x, topk_idx, topk_weight, experts)

    def __repr__(self) -> str:
        return f"LocalDispatcher(fused={self.fused})"
