"""Dense feed-forward block (dense layers and the shared experts of MoE layers).

Legend: T tokens (any leading dims), H hidden, F intermediate.
swiglu / swiglu_clamped: gate_proj, up_proj [F, H], down_proj [H, F] (Linear weights),
    y = down_proj(act(gate_proj(x), up_proj(x))) with act the definition of ``moetrain.ops.swiglu``
    (the one the routed experts use, which takes gate and up concatenated).
gelu: up_proj [F, H], down_proj [H, F], y = down_proj(gelu(up_proj(x))) (exact erf GELU); no gate.
No biases. The names are Hugging Face's (gate_proj/up_proj/down_proj): the HF adapters map them one
to one, and ``gate`` alone would read like HF's ``mlp.gate``, the MoE router.

Tensor parallelism: gate and up are separate modules, so ``ColwiseParallel`` on both (and
``RowwiseParallel`` on down_proj) gives each rank matching gate/up rows: act() works on local shards.

State dicts saved before the split hold ``<p>.w1`` [2F, H] (rows 0..F-1 gate, F..2F-1 up; [F, H] for
gelu) and ``<p>.w2`` [H, F]: ``load_state_dict`` (the MLP's, and so the model's) accepts them
(legacy.py has the mapping).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.legacy import apply_plan, mlp_entries
from moetrain.models.linear import Linear
from moetrain.ops.moe_rows import CLAMPED_ALPHA, CLAMPED_LIMIT

ACTIVATIONS = ("swiglu", "swiglu_clamped", "gelu")


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate, up) [..., F] from gate, up [..., F] (same dtype): ``moetrain.ops.swiglu`` of
    [gate | up] without building the concatenation.
    swiglu: silu(gate) * up; swiglu_clamped (GPT-OSS): gate clamped above at 7, up to [-7, 7],
    gate * sigmoid(1.702 * gate) * (up + 1)."""
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "swiglu_clamped":
        gate = gate.clamp(max=CLAMPED_LIMIT)
        up = up.clamp(min=-CLAMPED_LIMIT, max=CLAMPED_LIMIT)
        return gate * torch.sigmoid(CLAMPED_ALPHA * gate) * (up + 1)
    raise ValueError(f"unknown gated activation {activation!r}; valid: swiglu, swiglu_clamped")


class MLP(nn.Module):
    """x [..., H] -> [..., H]. Parameters: gate_proj.weight (not for gelu), up_proj.weight, down_proj.weight."""

    def __init__(self, hidden_size: int, ffn_size: int, activation: str = "swiglu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.gate_proj = None if activation == "gelu" else Linear(hidden_size, ffn_size)
        self.up_proj = Linear(hidden_size, ffn_size)
        self.down_proj = Linear(ffn_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(F.gelu(self.up_proj(x)))
        return self.down_proj(gated_activation(self.gate_proj(x), self.up_proj(x), self.activation))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Called before the children load from the same dict: renaming legacy entries here is enough.
        plan = mlp_entries(prefix, gated=self.gate_proj is not None, ffn=self.down_proj.in_features,
                           present=state_dict.keys())
        state_dict.update(apply_plan({k: state_dict.pop(k) for k in plan}, plan))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
