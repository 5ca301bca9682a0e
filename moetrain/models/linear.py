"""Linear and Embedding modules whose constructors allocate but never initialise.

torch.nn.Linear/Embedding draw random numbers in their constructors, which would make the
values depend on whether the model was built on a real device or on meta. Here every
parameter starts uninitialised (``torch.empty``) and ``MoETransformer.init_weights`` fills all
of them in one deterministic pass, so "build on meta, to_empty, init_weights" and "build on
the device" give identical weights for the same seed.

Shapes: Linear weight [out, in], bias [out]; Embedding weight [V, H].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"
