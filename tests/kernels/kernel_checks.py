"""Shared by the kernel test modules (plain torch: safe to import before triton): the relative error against a
float64 reference, with the NaN check that catches outputs a kernel never wrote (they are poisoned first)."""

import torch

FP32_BOUND = 1e-5  # fp32 accumulation over <= 100 terms, compared with fp64


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 on the CPU; fails on NaN (an unwritten, poisoned element)."""
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) or NaN outputs"
    want = want.double().cpu()
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()
