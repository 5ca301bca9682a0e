"""Shared by the kernel test modules (plain torch: safe to import before triton): the relative error against a
float64 reference, with the NaN check that catches outputs a kernel never wrote (they are poisoned first), and
the group layouts of the fused GEMM epilogue tests."""

import torch

FP32_BOUND = 1e-5  # fp32 accumulation over <= 100 terms, compared with fp64

# (name, offs, M) for the fused epilogues (fc1_swiglu, fc2_dgrad_swiglu): uneven and empty groups with rows past
# offs[-1], one group, many small groups
EPILOGUE_CASES = [
    ("uneven_empty_trailing", [10, 10, 47, 60], 70),
    ("one_group", [37], 37),
    ("many_groups", [3, 3, 20, 21, 40, 40, 58], 58),
]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 on the CPU; fails on NaN (an unwritten, poisoned element)."""
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) or NaN outputs"
    want = want.double().cpu()
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()
