"""Stable counting sort of the routed assignments by expert, in two launches: the routing half of the fused
expert path (``ops.moe``), with its inverse and the token of each row.

Legend: T tokens, K top-k, E experts, M = T*K assignments (flat a = t*K + k).

    sort_rows(topk_idx [T, K] int64, E) -> (offs [E] int32, row_map [M] int64, inverse [M] int64,
                                            token_of_row [M] int32)
    sort_rows(topk_idx, E, weights [T, K] float) -> the same and probs [M] fp32: probs[r] = weights.flat[row_map[r]],
                                            0 for a dropped assignment (the routing weights in row order)
    routing_weight_grad(dprobs [M] fp32, inverse, topk_idx, dtype) -> dweights [T, K] in dtype: probs' gradient
                                            gathered back (0 for a dropped assignment)

The key of assignment a is topk_idx.flat[a], a dropped one (-1) keyed E - 1 (grouped with the last expert,
as ``ops.moe.permute`` documents). Rows are sorted by key, ties by a: the order of torch.sort(stable=True).
row_map[r] = a, inverse[a] = r (row_map[inverse[a]] = a), token_of_row[r] = a // K, offs[e] = the number of
rows with key <= e (cumulative group ends).

Launch 1 (``_chunk_counts_kernel``): each program counts the keys of its chunk of CHUNK assignments.
Launch 2 (``_place_rows_kernel``): each program sums the counts of all chunks (the group starts) and of the
chunks before its own, then places its chunk SUB assignments at a time: an assignment's row is its group's start,
plus its key's assignments in earlier chunks, in earlier sub-blocks, and earlier in its own sub-block.
Why a kernel: torch's stable sort and the searchsorted and index ops around it were ~20 GPU operations, each a
host launch, between the routing and FC1 of every eager layer call, where the GPU waits on the host
(bench/host_overhead.md).
The weights ride along for the same reason: zeroing the dropped ones and gathering them in row order
were three more PyTorch ops there, each ~50-130 us of host time on the H200's host (`moetrain bench host`,
bench/archive/2026-11-30_0217-0349.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.grouped_gemm import _check_device, _on_device
from moetrain.kernels.host import cdiv, next_pow2, require_pow2
from moetrain.kernels.launch import launch

# The placing programs: chunks of at least MIN_CHUNK assignments, at most MAX_CHUNKS of them (each program reads every
# chunk's counts once), placed SUB at a time (a [SUB, SUB] comparison ranks a sub-block's keys) by PLACE_WARPS warps.
# `moetrain bench rows` on the H200 (bench/row_kernels.md): 512 / 32 / 2 warps placed Qwen3's 131072 rows
# in 27.9 us and DeepSeek-V3's 65536 in 21.3, against 58.0 and 45.1 for the earlier 1024 / 128 / 8 (torch's
# argsort-based sort: 52.0 and 44.8).
MIN_CHUNK = 512
MAX_CHUNKS = 256
SUB = 32
PLACE_WARPS = 2


@triton.jit
def _keys(idx_ptr, a, M, E):
    """[n] int32 keys of assignments a: the expert, E - 1 for a dropped one (< 0), 0 past M (callers mask those).
    An id >= E is a caller's bug: the counting kernel asserts it (device-side error); the placing kernel groups it
    with the last expert rather than write out of bounds."""
    raw = tl.load(idx_ptr + a, mask=a < M, other=0)
    tl.device_assert(raw < E, "sort_rows: topk_idx holds an expert id >= num_experts")
    return tl.where((raw < 0) | (raw >= E), E - 1, raw).to(tl.int32)


# debug=True keeps the device assert on an expert id >= E (a device-side error, as torch's index checks give):
# the kernel is tiny, the check one compare per assignment
@triton.jit(debug=True)
def _chunk_counts_kernel(idx_ptr, counts_ptr, M, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    a = c * CHUNK + tl.arange(0, CHUNK)
    counts = tl.histogram(_keys(idx_ptr, a, M, E), BLOCK_E)
    e = tl.arange(0, BLOCK_E)
    # lanes past M were keyed 0: take them out of expert 0's count
    counts -= tl.where(e == 0, tl.sum((a >= M).to(tl.int32), 0), 0)
    tl.store(counts_ptr + c * E + e, counts, mask=e < E)


@triton.jit
def _place_rows_kernel(idx_ptr, counts_ptr, offs_ptr, row_map_ptr, inverse_ptr, token_ptr, weight_ptr, probs_ptr, M,
                       E, K, n_chunks, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_C: tl.constexpr, HAS_WEIGHTS: tl.constexpr):
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, n_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        n = tl.load(counts_ptr + cs[:, None] * E + e[None, :], mask=(cs < n_chunks)[:, None] & e_ok[None, :],
                    other=0)
        total += tl.sum(n, 0)
        before += tl.sum(tl.where((cs < c)[:, None], n, 0), 0)
    ends = tl.cumsum(total, 0)
    if c == 0:
        tl.store(offs_ptr + e, ends, mask=e_ok)
    next_row = ends - total + before  # per key: the row of this chunk's next assignment of that key
    s = tl.arange(0, SUB)
    earlier = s[None, :] < s[:, None]
    for s0 in range(0, CHUNK, SUB):
        a = c * CHUNK + s0 + s
        ok = a < M
        key = _keys(idx_ptr, a, M, E)
        rank = tl.sum(((key[:, None] == key[None, :]) & earlier).to(tl.int32), 1)
        row = tl.gather(next_row, key, 0) + rank
        tl.store(row_map_ptr + row, a.to(tl.int64), mask=ok)
        tl.store(inverse_ptr + a, row.to(tl.int64), mask=ok)
        tl.store(token_ptr + row, a // K, mask=ok)
        if HAS_WEIGHTS:
            live = tl.load(idx_ptr + a, mask=ok, other=-1) >= 0
            w = tl.load(weight_ptr + a, mask=ok, other=0.0).to(tl.float32)
            tl.store(probs_ptr + row, tl.where(live, w, 0.0), mask=ok)
        # lanes past M (keyed 0) come last: they only follow the chunk's final sub-block
        next_row += tl.histogram(key, BLOCK_E)


@triton.jit
def _weight_grad_kernel(dprobs_ptr, inverse_ptr, idx_ptr, out_ptr, M, BLOCK: tl.constexpr):
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = a < M
    row = tl.load(inverse_ptr + a, mask=ok, other=0)
    live = tl.load(idx_ptr + a, mask=ok, other=-1) >= 0
    d = tl.load(dprobs_ptr + row, mask=ok & live, other=0.0)
    tl.store(out_ptr + a, d.to(out_ptr.dtype.element_ty), mask=ok)


def sort_rows(topk_idx: torch.Tensor, num_experts: int, weights: torch.Tensor | None = None, *,
              chunk: int | None = None, sub: int = SUB, warps: int = PLACE_WARPS):
    """(offs [E] int32, row_map [M] int64, inverse [M] int64, token_of_row [M] int32) of topk_idx [T, K] int64
    (see the module docstring), and probs [M] fp32 after them when ``weights`` [T, K] (any float dtype) is given;
    on CUDA or in the Triton interpreter. Sync-free. Not differentiable (ops.moe wraps it).
    chunk, sub, warps: the placing programs (assignments per program, default ``chunk_size``'s rule; placed at once;
    warps), powers of two with sub <= chunk; the row-kernel sweep's knobs."""
    _check_device(topk_idx, *([] if weights is None else [weights]))
    T, K = topk_idx.shape
    if weights is not None and tuple(weights.shape) != (T, K):
        raise ValueError(f"sort_rows: weights {tuple(weights.shape)} must be [T, K] = {(T, K)} like topk_idx")
    M, E = T * K, num_experts
    dev = topk_idx.device
    idx = topk_idx.contiguous()
    offs = torch.empty(E, dtype=torch.int32, device=dev)
    row_map = torch.empty(M, dtype=torch.int64, device=dev)
    inverse = torch.empty(M, dtype=torch.int64, device=dev)
    token_of_row = torch.empty(M, dtype=torch.int32, device=dev)
    probs = None if weights is None else torch.empty(M, dtype=torch.float32, device=dev)
    out = (offs, row_map, inverse, token_of_row) + (() if probs is None else (probs,))
    if M == 0:
        offs.zero_()
        return out
    chunk = chunk_size(M) if chunk is None else chunk
    for name, value in (("chunk", chunk), ("sub", sub), ("warps", warps)):
        require_pow2(f"sort_rows: {name}", value)
    if sub > chunk:
        raise ValueError(f"sort_rows: sub={sub} must be <= chunk={chunk}")
    n_chunks = cdiv(M, chunk)
    block_e = next_pow2(E)
    counts = torch.empty(n_chunks, E, dtype=torch.int32, device=dev)
    with _on_device(dev):
        launch(_chunk_counts_kernel, (n_chunks,), idx, counts, M, E, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
        launch(_place_rows_kernel, (n_chunks,), idx, counts, offs, row_map, inverse, token_of_row,
               idx if weights is None else weights.contiguous(), offs if probs is None else probs, M, E, K, n_chunks,
               CHUNK=chunk, SUB=sub, BLOCK_E=block_e, BLOCK_C=max(1, min(16, 4096 // block_e)),
               HAS_WEIGHTS=probs is not None, num_warps=warps)
    return out


def chunk_size(assignments: int) -> int:
    """Assignments per placing program: at least MIN_CHUNK, and at most MAX_CHUNKS programs."""
    return max(MIN_CHUNK, next_pow2(cdiv(assignments, MAX_CHUNKS)))


def routing_weight_grad(dprobs: torch.Tensor, inverse: torch.Tensor, topk_idx: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """dweights [T, K] in ``dtype``: dweights.flat[a] = dprobs[inverse[a]], 0 where topk_idx.flat[a] < 0 (a dropped
    assignment's row carries weight 0, so its weight gets no gradient): the backward of sort_rows' probs.
    dprobs [M] fp32, inverse [M] int64, topk_idx [T, K] int64."""
    _check_device(dprobs, inverse, topk_idx)
    out = torch.empty(topk_idx.shape, dtype=dtype, device=dprobs.device)
    M = topk_idx.numel()
    if M:
        block = 1024
        with _on_device(dprobs.device):
            launch(_weight_grad_kernel, (cdiv(M, block),), dprobs.contiguous(), inverse, topk_idx.contiguous(), out,
                   M, BLOCK=block, num_warps=4)
    return out
