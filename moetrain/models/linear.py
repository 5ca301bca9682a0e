"""Linear and Embedding: torch's own modules, minus the random initialisation in the constructor.

They subclass ``nn.Linear`` / ``nn.Embedding`` so that torch's tooling recognises them (DTensor's
``ColwiseParallel`` / ``RowwiseParallel`` refuse other module types; float8 conversion swaps
``nn.Linear`` only). torch's constructors call ``reset_parameters``, which draws random numbers:
the values would then depend on whether the model was built on a real device or on meta, and
the global RNG would advance at construction. Here ``reset_parameters`` does nothing, every
parameter starts uninitialised (``torch.empty``), and ``MoETransformer.init_weights`` fills all
of them in one deterministic pass, so "build on meta, to_empty, init_weights" and "build on
the device" give identical weights for the same seed.

Shapes: Linear weight [out, in], bias [out] (no bias by default, unlike nn.Linear);
Embedding weight [V, H].
"""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    """y [..., out] = x [..., in] @ weight.T (+ bias). Parameters uninitialised until init_weights."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """No-op: the model's ``init_weights`` sets every parameter (see the module docstring)."""


class Embedding(nn.Embedding):
    """out [..., H] = weight[ids [...]]. Weight uninitialised until init_weights."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """No-op: the model's ``init_weights`` sets every parameter (see the module docstring)."""
