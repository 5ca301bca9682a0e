"""Device-side tile schedules for the grouped GEMMs under skewed routing (plain torch, no triton).

With group-major tiles every persistent program works on the same group at once. Under skewed routing a small
group's tiles are bound by HBM (its weight slice read in the forward and data gradient, its dw written in the weight
gradient: one MMA step each) and a big group's by the tensor cores, and in step they never overlap: by roofline that
is +29-34% of DeepSeek-V3's six GEMMs against +13.6% when overlapped (scripts/skew_roofline.py, bench/NOTES.md
session 11). The "mix" schedule (kernels' MIX constexpr) takes the groups heaviest first and, where the routing is
skewed, walks half the programs' tiles backwards, so that light groups run under heavy ones, and deals odd rounds of
tiles in reverse program order ("snake"): with the heaviest groups first that evens out the programs' work, which
round-robin leaves uneven when a few groups have far more rows (Qwen3's skewed weight gradient: the busiest of 132
programs 7.5% over the mean, 1% with mix). Measured on the H200 in session 12 it did not pay: DeepSeek-V3's FC1
weight gradient took 11.4 ms on skewed routing against 9.9 with the plain schedule, and the forward / data gradient
came out level or slower (bench/NOTES.md); both kernels keep it on trial. The index arithmetic is written twice, in
grouped_gemm_kernels._rowgroup_kernel (Triton) and wgrad_pingpong._tile (Gluon): the two cannot share a jit
function."""

from __future__ import annotations

import torch

SKEWED_SHARE = 8  # routing is skewed when at least 1/SKEWED_SHARE of the groups have under one step of rows
STEP_ROWS = 64  # one reduction step of the weight gradient; half a 128-row tile of the forward


def skew_schedule(offs: torch.Tensor, step_rows: int = STEP_ROWS) -> torch.Tensor:
    """The MIX schedule of offs [G] int32 (group ends): [G + 1] int32 on offs' device, made without a host sync (CUDA
    graphs): the groups by row count, heaviest first (stable: ties keep their order), then 1 where at least
    1/SKEWED_SHARE of the groups have fewer than ``step_rows`` rows, else 0. The weight gradient's SORTED schedule
    takes the order alone."""
    rows = torch.diff(offs, prepend=offs.new_zeros(1))
    order = torch.argsort(rows, descending=True, stable=True).to(torch.int32)
    skewed = ((rows < step_rows).sum() * SKEWED_SHARE >= offs.numel()).to(torch.int32).reshape(1)
    return torch.cat([order, skewed])
