"""Device-side tile schedules for the grouped GEMMs under skewed routing.

    skew_schedule(offs [G] int, step_rows=64) -> sched [G + 1] int32 on offs' device, without a host sync:
        sched[:G] the groups by row count, heaviest first (stable: ties keep their order);
        sched[G]  1 where at least 1/SKEWED_SHARE of the groups have fewer than step_rows rows, else 0

With group-major tiles every persistent program works on the same group at once. Under skewed routing a small
group's tiles are bound by HBM (its weight slice read in the forward and data gradient, its dw written in the weight
gradient: one MMA step each) and a big group's by the tensor cores, and in step they never overlap: by roofline that
is +29-34% of DeepSeek-V3's six GEMMs against +13.6% when overlapped (`moetrain bench roofline`, bench/grouped_gemm.md).
Two schedules read this order:
- "sorted" (the ping-pong weight gradient's SORTED, an autotuner candidate): every program in step over the groups
  heaviest first, so the light groups' store-bound tiles come last, under the heavy groups' tail.
- "mix" (the kernels' MIX, trial configs only): where the routing is skewed (the flag), half the programs walk the tiles
  backwards, and odd rounds of tiles are dealt in reverse program order ("snake": with the heaviest groups first
  that evens out the programs' work; Qwen3's skewed weight gradient: the busiest of 132 programs 7.5% over the mean,
  1% with mix). On the H200 it does not pay: +16% on skewed routing, +3% on balanced (bench/grouped_gemm.md).
The index arithmetic that reads the schedule is written twice, in grouped_gemm_kernels._rowgroup_kernel (Triton) and
wgrad_pingpong._tile (Gluon): the two cannot share a jit function.

One Triton launch (``_skew_schedule_kernel``) makes it on CUDA and in the interpreter: each group's place is the
count of the groups before it in that order (a [BLOCK_I, G] comparison per program). The PyTorch version
(``skew_schedule_torch``, the reference) was ~8 operations around a stable argsort; made on every call, it cost the
sorted weight gradient 0.06-0.1 ms per call timed queued, as in a layer (Qwen3's FC1 weight gradient
1.34 ms sorted, 1.26 with the schedule made once, 1.27 plain), not a per-tile cost of the schedule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.grouped_gemm_configs import interpreting
from moetrain.kernels.host import cdiv, next_pow2
from moetrain.kernels.launch import launch

SKEWED_SHARE = 8  # routing is skewed when at least 1/SKEWED_SHARE of the groups have under one step of rows
STEP_ROWS = 64  # one reduction step of the weight gradient; half a 128-row tile of the forward


def skew_schedule_torch(offs: torch.Tensor, step_rows: int = STEP_ROWS) -> torch.Tensor:
    """skew_schedule in PyTorch operations (the reference; see the module docstring)."""
    rows = torch.diff(offs, prepend=offs.new_zeros(1))
    order = torch.argsort(rows, descending=True, stable=True).to(torch.int32)
    skewed = ((rows < step_rows).sum() * SKEWED_SHARE >= offs.numel()).to(torch.int32).reshape(1)
    return torch.cat([order, skewed])


@triton.jit
def _group_rows(offs_ptr, g, G):
    """Rows of groups g (a block of indices; 0 past G): offs[g] - offs[g - 1], offs[-1] read as 0."""
    ends = tl.load(offs_ptr + g, mask=g < G, other=0)
    starts = tl.load(offs_ptr + g - 1, mask=(g > 0) & (g < G), other=0)
    return ends - starts


@triton.jit
def _skew_schedule_kernel(offs_ptr, sched_ptr, G, step_rows, SHARE: tl.constexpr, BLOCK_I: tl.constexpr,
                          BLOCK_G: tl.constexpr):
    """Program p places groups p * BLOCK_I.. : sched[place(i)] = i, where place(i) counts the groups j with more rows
    than i, or as many and j < i. Program 0 also writes the flag sched[G]."""
    j = tl.arange(0, BLOCK_G)
    rows_j = _group_rows(offs_ptr, j, G)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    rows_i = _group_rows(offs_ptr, i, G)
    ahead = (rows_j[None, :] > rows_i[:, None]) | ((rows_j[None, :] == rows_i[:, None]) & (j[None, :] < i[:, None]))
    place = tl.sum((ahead & (j[None, :] < G)).to(tl.int32), axis=1)
    tl.store(sched_ptr + place, i.to(tl.int32), mask=i < G)
    if tl.program_id(0) == 0:
        light = tl.sum(((rows_j < step_rows) & (j < G)).to(tl.int32), axis=0)
        tl.store(sched_ptr + G, (light * SHARE >= G).to(tl.int32))


def skew_schedule(offs: torch.Tensor, step_rows: int = STEP_ROWS) -> torch.Tensor:
    """See the module docstring. offs [G] int32 or int64 group ends, G >= 1: by one Triton launch on CUDA or in the
    interpreter, else by skew_schedule_torch."""
    G = offs.numel()
    if G == 0 or not (offs.is_cuda or interpreting()):
        return skew_schedule_torch(offs, step_rows)
    block_g = max(16, next_pow2(G))
    block_i = max(1, min(64, 4096 // block_g))  # [BLOCK_I, BLOCK_G] compares: 32 per thread of 4 warps
    sched = torch.empty(G + 1, dtype=torch.int32, device=offs.device)
    launch(_skew_schedule_kernel, (cdiv(G, block_i),), offs.contiguous(), sched, G, step_rows, SHARE=SKEWED_SHARE,
           BLOCK_I=block_i, BLOCK_G=block_g, num_warps=4)
    return sched
