"""Top-k routing in one Triton kernel: scores, group-limited selection, top-k, normalized weights,
per-expert counts. The reference is the "torch" implementation of moetrain.ops.route (same steps).

Legend: T tokens, E experts, K top-k, G expert groups of GS = E / G consecutive experts.

    logits [T, E] (fp32 / bf16 / fp16)  ->  topk_idx [T, K] int64, topk_weight [T, K] fp32,
                                            counts [E] fp32 (zeroed here, then atomic adds of each program's counts)

One program per BLOCK_T tokens holds their logits as a [BLOCK_T, G * GS] tile (G and GS padded to powers of
two; no groups = one group of E), so group ranking and the expert top-k work on the same registers, and the
counts take one atomic add per expert per program. (One program per token with one atomic add per
assignment, all on E addresses, took 0.114 ms at Qwen3-30B-A3B's 16384 tokens x 128 experts
(bench/archive/2026-11-29_1543-1726.md); this kernel takes 0.033 ms there on the H200 (bench/row_kernels.md): ~3 us
of it is traffic, the rest is the K rounds of block reductions.)
The top-k is K rounds of argmax (ties: lower expert id), best first, like torch.topk's order.

With prob_sums, each program also writes the column sums of the aux loss's probabilities over its tokens (the
softmax scores, or the sigmoid scores normalized per token) into a [programs, E] buffer, summed on return: the batch
aux loss E * sum_e f_e * P_e then needs no [T, E] scores recomputed or kept, and the same bits every run (no
atomics).

The backward, route_backward, is one kernel too (its reference: moetrain.ops.route.topk_weights_backward;
PyTorch needed ~17 small ops, each 50-80 us of host time on the H200 host: `moetrain bench host`,
bench/archive/2026-11-30_0217-0349.md):

    logits [T, E] (fp32 / bf16 / fp16), topk_idx [T, K] int64, dweight [T, K] (any float)
        ->  dlogits [T, E] in logits' dtype (fp32 math)

One program per BLOCK_T tokens recomputes their scores from the logits (the same tiling as the forward,
over BLOCK_E = next_pow2(E) experts) and spreads the K weight gradients over a dense [BLOCK_T, BLOCK_E]
tile by compares with each topk_idx column, so that the normalization's sums and the softmax's are plain
row reductions: no gathers, no scatters, no atomics. The prob sums' gradient dpsum [E] joins the same score
gradient (every token's probability of e gets dpsum[e]), before the softmax / sigmoid backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.host import cdiv, next_pow2, require_pow2

from moetrain.kernels.grouped_gemm import _check_device, _on_device
from moetrain.kernels.launch import launch


def route_ref(logits: torch.Tensor, topk: int, **kw):
    """The reference: moetrain.ops.route's PyTorch implementation (a Routing)."""
    from moetrain.ops.route import route as route_op

    return route_op(logits, topk, impl="torch", **kw)


@triton.jit
def _scores(x, valid, SIGMOID: tl.constexpr):
    """fp32 logits [BLOCK_T, BLOCK_E] (-inf at padded slots, valid [BLOCK_E]) -> scores, 0 at padded slots: sigmoid,
    or softmax over the row. One function for both kernels: the backward recomputes the forward's scores."""
    if SIGMOID:
        return tl.where(valid[None, :], tl.sigmoid(x), 0.0)
    e = tl.where(valid[None, :], tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, bias_ptr, idx_ptr, weight_ptr, counts_ptr, psum_ptr, T, E, scaling,
                  TOPK: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, TOP2_SUM: tl.constexpr, NORMALIZE: tl.constexpr,
                  HAS_PSUM: tl.constexpr):
    rt = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = rt < T
    t = tl.minimum(rt, T - 1)  # rows past T redo the last token; nothing of theirs is stored or counted
    # Slot s of the [BLOCK_T, BLOCK_E] tile holds expert g * GROUP_SIZE + j, g = s // BLOCK_GS, j = s % BLOCK_GS.
    # The tile stays two-dimensional throughout: only the group scores view it as [BLOCK_T, BLOCK_G, BLOCK_GS], and
    # the chosen groups come back as a compare per slot (a [tokens, groups, group size] tile flattened for the top-k
    # picked experts past E with 2 tokens per program on the H200, Triton 3.6: bench/row_kernels.md)
    BLOCK_E: tl.constexpr = BLOCK_G * BLOCK_GS
    slot = tl.arange(0, BLOCK_E)
    group_of = slot // BLOCK_GS
    member = slot % BLOCK_GS
    expert = group_of * GROUP_SIZE + member
    valid = (group_of < GROUPS) & (member < GROUP_SIZE)
    x = tl.load(logits_ptr + t[:, None] * E + expert[None, :], mask=valid[None, :],
                other=-float("inf")).to(tl.float32)  # [BLOCK_T, BLOCK_E]
    s = _scores(x, valid, SIGMOID)
    if HAS_PSUM:  # this program's column sums of the aux loss's probabilities (a row of psum_ptr [programs, E])
        p = s
        if SIGMOID:  # normalized over the experts per token, as the PyTorch loss does
            p = s / tl.sum(s, axis=1)[:, None]
        p = tl.sum(tl.where(tok_ok[:, None], p, 0.0), axis=0)
        tl.store(psum_ptr + tl.program_id(0).to(tl.int64) * E + expert, p, mask=valid)
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + expert, mask=valid, other=0.0)[None, :]
    sel = tl.where(valid[None, :], sel, -float("inf"))
    if TOPK_GROUPS < GROUPS:
        by_group = tl.reshape(sel, [BLOCK_T, BLOCK_G, BLOCK_GS])
        gscore = tl.max(by_group, axis=2)  # [BLOCK_T, BLOCK_G]
        if TOP2_SUM:
            j = tl.arange(0, BLOCK_GS)
            first = tl.argmax(by_group, axis=2)
            gscore = gscore + tl.max(tl.where(j[None, None, :] == first[:, :, None], -float("inf"), by_group), axis=2)
        g = tl.arange(0, BLOCK_G)
        gscore = tl.where(g[None, :] < GROUPS, gscore, -float("inf"))
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            best_g = tl.argmax(gscore, axis=1)  # [BLOCK_T]
            gscore = tl.where(g[None, :] == best_g[:, None], -float("inf"), gscore)
            keep = keep | (group_of[None, :] == best_g[:, None])
        sel = tl.where(keep, sel, -float("inf"))
    ks = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    picks = tl.zeros([BLOCK_E], dtype=tl.float32)  # this block's assignments per slot
    for k in tl.static_range(TOPK):
        best = tl.argmax(sel, axis=1)  # [BLOCK_T]
        chosen = slot[None, :] == best[:, None]
        e_id = tl.sum(tl.where(chosen, expert[None, :], 0), axis=1)
        ids = tl.where(ks[None, :] == k, e_id.to(tl.int64)[:, None], ids)
        w_k = tl.sum(tl.where(chosen, s, 0.0), axis=1)
        weights = tl.where(ks[None, :] == k, w_k[:, None], weights)
        sel = tl.where(chosen, -float("inf"), sel)
        picks += tl.sum(tl.where(chosen & tok_ok[:, None], 1.0, 0.0), axis=0)
    if NORMALIZE:
        total = tl.sum(weights, axis=1)
        if SIGMOID:
            total = total + 1e-20
        weights = weights / total[:, None]
    out = tok_ok[:, None] & (ks[None, :] < TOPK)
    tl.store(idx_ptr + rt[:, None] * TOPK + ks[None, :], ids, mask=out)
    tl.store(weight_ptr + rt[:, None] * TOPK + ks[None, :], weights * scaling, mask=out)
    # One atomic per expert per program (see the module docstring)
    slot_ok = valid & (picks > 0)
    tl.atomic_add(counts_ptr + expert, picks, mask=slot_ok)


@triton.jit(do_not_specialize=["T"])
def _route_bwd_kernel(logits_ptr, idx_ptr, dweight_ptr, dpsum_ptr, dlogits_ptr, T, E, scaling,
                      stride_lt, stride_le, stride_it, stride_ik, stride_dt, stride_dk,
                      TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr, HAS_DWEIGHT: tl.constexpr,
                      HAS_DPSUM: tl.constexpr):
    rt = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = rt < T
    t = tl.minimum(rt, T - 1)  # rows past T redo the last token (an all -inf row would give NaNs); not stored
    expert = tl.arange(0, BLOCK_E)
    valid = expert < E
    x = tl.load(logits_ptr + t[:, None] * stride_lt + expert[None, :] * stride_le, mask=valid[None, :],
                other=-float("inf")).to(tl.float32)  # [BLOCK_T, BLOCK_E]
    s = _scores(x, valid, SIGMOID)
    # Dense per-expert sums over the picks (a repeated id adds up, as the reference's scatter_add does):
    # ds = dL/d(chosen score) before the normalization, picks = how often each expert was chosen
    ds = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_DWEIGHT:
        picks = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for k in tl.static_range(TOPK):
            # int32: half the registers of the K id columns a thread holds for its rows, 32-bit compares
            idx_k = tl.load(idx_ptr + t * stride_it + k * stride_ik).to(tl.int32)
            g_k = tl.load(dweight_ptr + t * stride_dt + k * stride_dk).to(tl.float32) * scaling
            hit = expert[None, :] == idx_k[:, None]
            ds += tl.where(hit, g_k[:, None], 0.0)
            picks += tl.where(hit, 1.0, 0.0)
        if NORMALIZE:
            # w_k = c s_k / S with S the chosen scores' sum: dL/ds_k = (g_k - sum_j g_j s_j / S) / S (g includes c)
            denom = tl.sum(picks * s, axis=1)
            if SIGMOID:
                denom = denom + 1e-20
            mean = tl.sum(ds * s, axis=1) / denom
            ds = (ds - picks * mean[:, None]) / denom[:, None]
    if HAS_DPSUM:  # psum[e] = sum_t p[t, e]: every token's p gets dpsum; p = s (softmax) or s / sum_e s (sigmoid)
        dp = tl.load(dpsum_ptr + expert, mask=valid, other=0.0)
        if SIGMOID:
            total = tl.sum(s, axis=1)
            ds += (dp[None, :] - tl.sum(dp[None, :] * s, axis=1)[:, None] / total[:, None]) / total[:, None]
        else:
            ds += dp[None, :]
    if SIGMOID:
        d = ds * s * (1.0 - s)
    else:
        d = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    tl.store(dlogits_ptr + rt[:, None] * E + expert[None, :], d.to(dlogits_ptr.dtype.element_ty),
             mask=tok_ok[:, None] & valid[None, :])


# Tokens per program where no measurement below applies: a [BLOCK_T, E] tile of ~4K scores at 4 warps
ROUTE_TILE = 4096
# (tokens per program, warps) by E rounded to a power of two, (forward, backward): the fastest programs that
# `moetrain bench rows` timed on the H200 at Qwen3's 128 experts and DeepSeek-V3's 256 without expert groups
# (bench/row_kernels.md, each pair from one run. From ROUTE_TILE: forward 50.8 -> 33.6 us and 58.7 -> 38.2, backward
# 11.9 -> 9.4 and 14.3 -> 9.8; at 256 experts, one token on one warp against 2 on 2: forward 43.3 -> 29.7,
# backward 9.8 -> 7.9). Fewer scores per program than ROUTE_TILE, on fewer warps: the K rounds of row reductions
# are the kernel's latency, and more programs hide it. At Mixtral's 8 and GPT-OSS's 32 experts (16 tokens per program,
# against ~4096 scores on 4 warps): forward 13.2 -> 5.4 and 11.9 -> 7.5 us, backward 8.0 -> 2.3 and 4.5 -> 3.1.
MEASURED_PROGRAMS = {8: ((16, 1), (16, 2)), 32: ((16, 2), (16, 4)), 128: ((8, 2), (2, 2)), 256: ((1, 1), (1, 1))}
# The group-limited forward (the backward is the same kernel with or without groups): DeepSeek-V3's own routing
# (sigmoid + bias, 8 groups ranked by their two best scores, 4 kept) at 256 experts, and the same routing at
# Qwen3's 128 (from ROUTE_TILE: 73.4 -> 40.3 us and 62.4 -> 44.9 us).
MEASURED_GROUPED_FORWARD = {128: (4, 2), 256: (1, 1)}


def _program(block_e: int, T: int, chosen: int | None, warps: int | None, backward: bool,
             grouped: bool = False) -> tuple[int, int]:
    """(tokens per program, warps): ``chosen`` / ``warps`` where given (the sweep's knobs; powers of two), else
    the measured program for E (MEASURED_GROUPED_FORWARD for the group-limited forward, else MEASURED_PROGRAMS), else
    ~ROUTE_TILE scores on 4 warps; never more tokens than the (power-of-two rounded) token count."""
    if chosen is not None:
        require_pow2("route: tokens_per_program", chosen)
    if warps is not None:
        require_pow2("route: warps", warps)
    if grouped and not backward:
        measured = MEASURED_GROUPED_FORWARD.get(block_e)
    else:
        measured = MEASURED_PROGRAMS.get(block_e, (None, None))[backward]
    tokens, rule_warps = measured or (max(1, ROUTE_TILE // block_e), 4)
    return chosen or min(tokens, next_pow2(T)), warps or rule_warps


def route(logits: torch.Tensor, topk: int, score: str, num_groups: int | None, topk_groups: int | None,
          group_score: str, expert_bias: torch.Tensor | None, scaling_factor: float, normalize: bool,
          prob_sums: bool = False, tokens_per_program: int | None = None, warps: int | None = None):
    """(topk_idx [T, K] int64, topk_weight [T, K] fp32, counts [E] fp32, psum [E] fp32 or None); arguments as
    ops.route (checked there). prob_sums: psum[e] = sum over tokens of the aux loss's probability of e (the
    softmax scores, or the sigmoid scores normalized per token), from per-program column sums (no atomics: the
    same bits every run). tokens_per_program, warps: the program (default: ``_program``'s rule)."""
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
        return idx, weight, counts, counts.clone() if prob_sums else None
    bias = expert_bias.to(torch.float32).contiguous() if expert_bias is not None else logits
    block_g, block_gs = next_pow2(groups), next_pow2(group_size)
    block_t, warps = _program(block_g * block_gs, T, tokens_per_program, warps, backward=False, grouped=groups > 1)
    programs = cdiv(T, block_t)
    parts = torch.empty(programs, E, dtype=torch.float32, device=logits.device) if prob_sums else counts
    with _on_device(logits.device):
        launch(_route_kernel, (programs,),
            logits, bias, idx, weight, counts, parts, T, E, float(scaling_factor),
            TOPK=topk, BLOCK_K=next_pow2(topk), GROUPS=groups, GROUP_SIZE=group_size,
            BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_GS=block_gs,
            TOPK_GROUPS=topk_groups if num_groups is not None else groups, SIGMOID=score == "sigmoid",
            HAS_BIAS=expert_bias is not None, TOP2_SUM=group_score == "top2_sum", NORMALIZE=normalize,
            HAS_PSUM=prob_sums, num_warps=warps)
    return idx, weight, counts, parts.sum(0) if prob_sums else None


def route_backward(logits: torch.Tensor, topk_idx: torch.Tensor, dweight: torch.Tensor | None, score: str,
                   normalize: bool, scaling_factor: float, dpsum: torch.Tensor | None = None,
                   tokens_per_program: int | None = None, warps: int | None = None) -> torch.Tensor:
    """d loss / d logits of the forward's topk_weight (and of its psum, given dpsum), in one kernel (see the module
    docstring). logits [T, E] fp32 / bf16 / fp16, topk_idx [T, K] int64 (the forward's), dweight [T, K] any float
    dtype or None (no gradient reached the weights), dpsum [E] or None -> dlogits [T, E] in logits' dtype
    (contiguous). Any strides: an expanded dweight is read in place. tokens_per_program, warps: as ``route``'s."""
    _check_device(logits, topk_idx, *(t for t in (dweight, dpsum) if t is not None))
    if logits.dtype == torch.float64:
        raise ValueError("the Triton router computes in fp32; use impl='torch' for fp64 logits")
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown score function {score!r}; valid: softmax, sigmoid")
    T, E = logits.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != T or (dweight is not None and dweight.shape != topk_idx.shape):
        raise ValueError(f"route_backward: topk_idx {tuple(topk_idx.shape)} and dweight "
                         f"{None if dweight is None else tuple(dweight.shape)} must both be [T, K] with T = {T}")
    if dpsum is not None and tuple(dpsum.shape) != (E,):
        raise ValueError(f"route_backward: dpsum {tuple(dpsum.shape)} must be [E] = [{E}]")
    dlogits = torch.empty(T, E, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return dlogits
    if dweight is None and dpsum is None:
        return dlogits.zero_()
    block_e = next_pow2(E)
    block_t, warps = _program(block_e, T, tokens_per_program, warps, backward=True)
    dw = dweight if dweight is not None else topk_idx  # (unread without HAS_DWEIGHT)
    with _on_device(logits.device):
        launch(_route_bwd_kernel, (cdiv(T, block_t),),
            logits, topk_idx, dw, dpsum.float().contiguous() if dpsum is not None else logits, dlogits, T, E,
            float(scaling_factor), logits.stride(0), logits.stride(1), topk_idx.stride(0), topk_idx.stride(1),
            dw.stride(0), dw.stride(1),
            TOPK=topk_idx.shape[1], BLOCK_T=block_t, BLOCK_E=block_e, SIGMOID=score == "sigmoid",
            NORMALIZE=normalize, HAS_DWEIGHT=dweight is not None, HAS_DPSUM=dpsum is not None, num_warps=warps)
    return dlogits
