"""RMSNorm computed in fp32 and cast back to the input dtype.

Shapes: x [..., D] -> [..., D]; weight [D].
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim, in fp32 (fp64 stays fp64), result in x.dtype: the
    computation of ``RMSNorm`` (whose doc says why the weight is applied before the cast)."""
    dt = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 stays fp64)
    xf = x.to(dt)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(dt) * xf).to(x.dtype)


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), all in fp32, result in x.dtype.

    The weight is applied in fp32 before the cast (as GPT-OSS does); for fp32 models this is
    identical to the Llama/DeepSeek order, for bf16 it differs only by one rounding.
    Parameters are created uninitialised; ``MoETransformer.init_weights`` sets them to 1.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
