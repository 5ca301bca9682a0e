"""Dense feed-forward block (dense layers and the shared experts of MoE layers).

Legend: T tokens (any leading dims), H hidden, F intermediate.
swiglu / swiglu_clamped: w1 [2F, H] (rows 0..F-1 gate, F..2F-1 up), w2 [H, F],
    y = w2 @ act(w1 @ x) with act from ``moetrain.ops.swiglu`` (the same definition the
    routed experts use).
gelu: w1 [F, H], w2 [H, F], y = w2 @ gelu(w1 @ x) (exact erf GELU). No biases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import ops

ACTIVATIONS = ("swiglu", "swiglu_clamped", "gelu")


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, activation: str = "swiglu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
        self.activation = activation
        rows = ffn_size if activation == "gelu" else 2 * ffn_size
        self.w1 = nn.Parameter(torch.empty(rows, hidden_size))
        self.w2 = nn.Parameter(torch.empty(hidden_size, ffn_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.w1)
        if self.activation == "gelu":
            a = F.gelu(h)
        else:
            a = ops.swiglu(h, self.activation)
        return F.linear(a, self.w2)
