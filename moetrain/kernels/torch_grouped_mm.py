"""The three grouped GEMMs of an MoE layer as torch._grouped_mm calls: the "torch" backend, and the peer our kernels
are tuned and benchmarked against. Plain torch (no triton import).

    fwd    y  [M, N]    = a_g @ b[g]^T    a = x  [M, K], b = w [G, N, K]
    dgrad  dx [M, K]    = a_g @ b[g]      a = dy [M, N], b = w [G, N, K]
    wgrad  dw [G, N, K] = a_g^T @ b_g     a = dy [M, N], b = x [M, K]

offs [G] int32 group ends on a's device; bf16 / fp16 on a GPU torch._grouped_mm supports (CUDA, sm_90+ here).
"""

from __future__ import annotations

import torch


def torch_grouped_mm(op: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One grouped GEMM (op "fwd", "dgrad" or "wgrad"; "fwd_gather" / "wgrad_gather" as their plain forms, on rows
    already gathered) by torch._grouped_mm, the calls torch's own autograd of _grouped_mm makes."""
    if op in ("fwd", "fwd_gather"):
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    if op == "dgrad":
        return torch._grouped_mm(a, b, offs=offs)
    if op not in ("wgrad", "wgrad_gather"):
        raise ValueError(f"unknown grouped GEMM op {op!r}; valid: fwd, dgrad, wgrad")
    # dy^T as the column-major left operand gives dw [G, N, K] in w's own layout: the transposed result of
    # x^T @ dy would cost a strided copy when autograd stores it as w.grad (3 ms at Mixtral)
    return torch._grouped_mm(a.t(), b, offs=offs)
