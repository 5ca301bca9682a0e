"""Top-k routing in one Triton kernel: scores, group-limited selection, top-k, normalized weights,
per-expert counts. The reference is the "torch" implementation of moetrain.ops.route (same steps).

Legend: T tokens, E experts, K top-k, G expert groups of GS = E / G consecutive experts.

    logits [T, E] (fp32 / bf16 / fp16)  ->  topk_idx [T, K] int64, topk_weight [T, K] fp32,
                                            counts [E] fp32 (zeroed here, then one atomic add per assignment)

One program per token holds the token's logits as a [G, GS] tile (padded to powers of two; no
groups = one group of E), so group ranking and the expert top-k work on the same registers.
The top-k is K rounds of argmax (ties: lower expert id), best first, like torch.topk's order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.host import next_pow2

from moetrain.kernels.grouped_gemm import _check_device, _on_device


def route_ref(logits: torch.Tensor, topk: int, **kw):
    """The reference: moetrain.ops.route's PyTorch implementation (a Routing)."""
    from moetrain.ops.route import route as route_op

    return route_op(logits, topk, impl="torch", **kw)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, idx_ptr, weight_ptr, counts_ptr, E, scaling,
                  TOPK: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, TOP2_SUM: tl.constexpr, NORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_GS)
    expert = g[:, None] * GROUP_SIZE + j[None, :]  # [BLOCK_G, BLOCK_GS]
    valid = (g[:, None] < GROUPS) & (j[None, :] < GROUP_SIZE)
    x = tl.load(logits_ptr + t * E + expert, mask=valid, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        s = tl.where(valid, tl.sigmoid(x), 0.0)
    else:
        e = tl.where(valid, tl.exp(x - tl.max(tl.max(x, axis=1), axis=0)), 0.0)
        s = e / tl.sum(tl.sum(e, axis=1), axis=0)
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    sel = tl.where(valid, sel, -float("inf"))
    if TOPK_GROUPS < GROUPS:
        gscore = tl.max(sel, axis=1)
        if TOP2_SUM:
            first = tl.argmax(sel, axis=1)
            gscore = gscore + tl.max(tl.where(j[None, :] == first[:, None], -float("inf"), sel), axis=1)
        gscore = tl.where(g < GROUPS, gscore, -float("inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUPS):
            best_g = tl.argmax(gscore, axis=0)
            keep = keep | (g == best_g)
            gscore = tl.where(g == best_g, -float("inf"), gscore)
        sel = tl.where(keep[:, None], sel, -float("inf"))
    flat_sel = tl.reshape(sel, [BLOCK_G * BLOCK_GS])
    flat_s = tl.reshape(s, [BLOCK_G * BLOCK_GS])
    flat_expert = tl.reshape(expert, [BLOCK_G * BLOCK_GS])
    slot = tl.arange(0, BLOCK_G * BLOCK_GS)
    ks = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        best = tl.argmax(flat_sel, axis=0)
        chosen = slot == best
        e_id = tl.sum(tl.where(chosen, flat_expert, 0), axis=0)
        ids = tl.where(ks == k, e_id.to(tl.int64), ids)
        weights = tl.where(ks == k, tl.sum(tl.where(chosen, flat_s, 0.0), axis=0), weights)
        flat_sel = tl.where(chosen, -float("inf"), flat_sel)
        tl.atomic_add(counts_ptr + e_id, 1.0)
    if NORMALIZE:
        total = tl.sum(weights, axis=0)
        if SIGMOID:
            total = total + 1e-20
        weights = weights / total
    out = ks < TOPK
    tl.store(idx_ptr + t * TOPK + ks, ids, mask=out)
    tl.store(weight_ptr + t * TOPK + ks, weights * scaling, mask=out)


def route(logits: torch.Tensor, topk: int, score: str, num_groups: int | None, topk_groups: int | None,
          group_score: str, expert_bias: torch.Tensor | None, scaling_factor: float, normalize: bool):
    """(topk_idx [T, K] int64, topk_weight [T, K] fp32, counts [E] fp32); arguments as ops.route
    (checked there)."""
    _check_device(logits, *([] if expert_bias is None else [expert_bias]))
    if logits.dtype == torch.float64:
        raise ValueError("the Triton router computes in fp32; use impl='torch' for fp64 logits")
    T, E = logits.shape
    logits = logits.contiguous()
    groups = num_groups or 1
    group_size = E // groups
    idx = torch.empty(T, topk, dtype=torch.int64, device=logits.device)
    weight = torch.empty(T, topk, dtype=torch.float32, device=logits.device)
    counts = torch.zeros(E, dtype=torch.float32, device=logits.device)
    if T == 0:
        return idx, weight, counts
    bias = expert_bias.to(torch.float32).contiguous() if expert_bias is not None else logits
    with _on_device(logits.device):
        _route_kernel[(T,)](
            logits, bias, idx, weight, counts, E, float(scaling_factor),
            TOPK=topk, BLOCK_K=next_pow2(topk), GROUPS=groups, GROUP_SIZE=group_size,
            BLOCK_G=next_pow2(groups), BLOCK_GS=next_pow2(group_size),
            TOPK_GROUPS=topk_groups if num_groups is not None else groups, SIGMOID=score == "sigmoid",
            HAS_BIAS=expert_bias is not None, TOP2_SUM=group_score == "top2_sum", NORMALIZE=normalize,
            num_warps=4)
    return idx, weight, counts
