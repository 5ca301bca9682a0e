"""Routed experts: stacked weights, computed by ``moetrain.ops.moe_experts`` or on dispatched rows.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M routed rows.
w1 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up), w2 [E, H, I], optional b1 [E, 2I], b2 [E, H].
FFN_e(x) = w2[e] @ act(w1[e] @ x + b1[e]) + b2[e]; the layer output for token t is
sum_k topk_weight[t, k] * FFN_{topk_idx[t, k]}(x[t]) (topk_idx -1 = dropped, contributes 0).
The weights stay stacked with gate and up in one w1: expert parallelism shards dim 0 (whole experts).
Which kernel runs is ops' choice (moe.backend), never decided here.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain import ops
from moetrain.config.schema import FP8_FUSED
from moetrain.ops.dispatch import expert_of_rows
from moetrain.ops.moe import expert_gemm_backend
from moetrain.runtime.expert_plan import plan_for


def _local(p: torch.Tensor | None) -> torch.Tensor | None:
    """The experts this rank holds: a DTensor's local shard (expert parallelism shards dim 0 from outside), or p."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


class Experts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        e, H = cfg.moe, cfg.model.hidden_size
        E, I = e.num_experts, e.moe_ffn_hidden_size
        self.activation, self.backend = e.activation, e.backend
        self.fp8_recipe = cfg.precision.fp8_recipe  # "none": the GEMMs in the compute dtype
        self.w1 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        self.b1 = nn.Parameter(torch.empty(E, 2 * I)) if e.expert_linear_bias else None
        self.b2 = nn.Parameter(torch.empty(E, H)) if e.expert_linear_bias else None

    def runs_fused(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` (the fused path: token rows never permuted in 16 bits) computes x [T, H]: the 16/32-bit
        GEMMs, and rowwise / tensorwise FP8 without expert biases where the FP8 kernels run (``ops.moe_experts_fp8``).
        Otherwise the dispatcher permutes the rows for ``compute_rows``."""
        if self.fp8_recipe == "none":
            return True
        from moetrain.ops.grouped_gemm_fp8 import kernels_run_here

        return self.fp8_recipe in FP8_FUSED and self.b1 is None and self.b2 is None and kernels_run_here(x)

    @property
    def num_experts(self) -> int:
        """Experts held here (all of them, or this rank's share under expert parallelism)."""
        return _local(self.w1).shape[0]

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """The fused path: x [T, H], topk_idx [T, K] int64, topk_weight [T, K] fp32 -> [T, H] in x.dtype (16/32-bit
        GEMMs, or the FP8 recipes of ``runs_fused``; the others take ``compute_rows``)."""
        if self.fp8_recipe != "none":
            if not self.runs_fused(x):
                raise ValueError(f"Experts.forward: FP8 recipe {self.fp8_recipe} runs on dispatched rows here "
                                 "(compute_rows), not the fused path (Experts.runs_fused)")
            from moetrain.ops.moe_fp8 import moe_experts_fp8

            return moe_experts_fp8(x, topk_idx, topk_weight, _local(self.w1), _local(self.w2),
                                   activation=self.activation, recipe=self.fp8_recipe)
        return ops.moe_experts(x, topk_idx, topk_weight, self.w1, self.w2, b1=self.b1, b2=self.b2,
                               activation=self.activation, backend=self.backend)

    def compute_rows(self, rows: torch.Tensor, offs: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """FFN of dispatched rows: rows [M, H] sorted by expert, offs [E] int32 group ends, probs [M] fp32 (routing
        weights applied to the activation before FC2) or None -> y [M, H] in rows.dtype."""
        gemm = expert_gemm_backend(self.backend, rows)  # (the plan's GEMM backend, triton checked)
        impl = plan_for(rows, self.backend).rows
        w1, w2, b1, b2 = (_local(p) for p in (self.w1, self.w2, self.b1, self.b2))
        expert = None if b1 is None and b2 is None else expert_of_rows(offs, rows.shape[0])
        h = ops.grouped_gemm(rows, w1, offs, gemm, recipe=self.fp8_recipe)
        if b1 is not None:
            h = h + b1.index_select(0, expert)
        a = ops.swiglu(h, self.activation, probs=probs, impl=impl)
        y = ops.grouped_gemm(a, w2, offs, gemm, recipe=self.fp8_recipe)
        if b2 is not None:
            y = y + b2.index_select(0, expert)
        return y

    def extra_repr(self) -> str:
        E, I2, H = _local(self.w1).shape
        return f"experts={E}, hidden={H}, intermediate={I2 // 2}, activation={self.activation}"
