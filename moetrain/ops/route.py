"""Top-k routing: scores, (group-limited) top-k selection, normalized weights and per-expert counts.

Legend: T tokens, E experts, K top-k, G expert groups.

    route(logits [T, E], topk) -> Routing(topk_idx [T, K] int64, topk_weight [T, K], counts [E] fp32,
                                          scores [T, E] or None)

1. scores = softmax(logits) or sigmoid(logits), in fp32 (fp64 logits stay fp64).
2. selection = scores + expert_bias (aux-loss-free balancing: the bias picks experts, never weighs
   them). With num_groups, the G groups of E/G consecutive experts are ranked by the max or the
   top-2 sum of their selection scores, and only the best topk_groups groups stay selectable.
3. topk_idx = the K best selectable experts, best first; topk_weight = their unbiased scores,
   with normalize divided by their sum (sigmoid: + 1e-20), times scaling_factor. Differentiable
   in logits.
4. counts[e] = number of assignments to e.
5. with prob_sums: prob_sums[e] = sum over tokens of the aux loss's probability of e (softmax scores, or
   sigmoid scores divided by their sum per token); differentiable in the logits.

impl "torch": plain PyTorch ops (the reference). impl "triton": one kernel for steps 1-4 (one
program per block of tokens; the counts by integer-valued fp32 atomics, exact below 2^24), and one
kernel for its backward (moetrain.kernels.route.route_backward: the weights' chain rule, whose PyTorch
form topk_weights_backward is its reference). Both are sync-free, and both kernels are custom ops
(moetrain.ops.custom_ops), so a torch.compile'd layer traces the Triton routing too. Ties in the selection go to
the lower expert id in the kernel; torch.topk does not specify, so tests use distinct scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.ops.custom_ops import kernel_op
from moetrain.ops.grouped_gemm import require_triton
from moetrain.runtime.expert_plan import plan_for

SCORES = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


@dataclass
class Routing:
    topk_idx: torch.Tensor  # [T, K] int64
    topk_weight: torch.Tensor  # [T, K], dtype of the scores (fp32, or fp64 for fp64 logits)
    counts: torch.Tensor  # [E] fp32, assignments per expert
    scores: torch.Tensor | None  # [T, E] softmax / sigmoid of the logits (torch impl; triton: None)
    # [E] fp32 with prob_sums: sum over tokens of each expert's aux-loss probability (the softmax scores, or the
    # sigmoid scores normalized per token); differentiable in the logits
    prob_sums: torch.Tensor | None = None


def scores_of(logits: torch.Tensor, score: str) -> torch.Tensor:
    """[T, E] softmax or sigmoid of the logits, in fp32 at least."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if score == "softmax":
        return torch.softmax(logits, dim=-1)
    if score == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"unknown score function {score!r}; valid: {', '.join(SCORES)}")


def group_limited_mask(sel: torch.Tensor, num_groups: int, topk_groups: int, group_score: str) -> torch.Tensor:
    """[T, E] bool: True for experts inside the topk_groups best groups of each token.
    Groups are ranked on the selection scores sel [T, E] by max or top-2 sum."""
    T, E = sel.shape
    grouped = sel.view(T, num_groups, E // num_groups)
    if group_score == "max":
        gscore = grouped.amax(dim=-1)
    elif group_score == "top2_sum":
        gscore = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        raise ValueError(f"unknown group score {group_score!r}; valid: {', '.join(GROUP_SCORES)}")
    best = gscore.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    gmask = torch.zeros(T, num_groups, dtype=torch.bool, device=sel.device).scatter_(1, best, True)
    return gmask.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)


def expert_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] fp32 number of assignments per expert; entries < 0 are not counted.
    scatter_add rather than bincount: CUDA bincount reads its max on the host."""
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    counts = torch.zeros(num_experts, device=flat.device, dtype=torch.float32)
    return counts.scatter_add_(0, flat.clamp(min=0), valid.to(torch.float32))


def topk_weights(scores: torch.Tensor, topk_idx: torch.Tensor, score: str, normalize: bool,
                 scaling_factor: float) -> torch.Tensor:
    """[T, K] weights of the chosen experts from the (unbiased) scores (step 3)."""
    weight = scores.gather(1, topk_idx)
    if normalize:
        denom = weight.sum(-1, keepdim=True)
        weight = weight / (denom + 1e-20 if score == "sigmoid" else denom)
    return weight * scaling_factor


def topk_weights_backward(logits: torch.Tensor, topk_idx: torch.Tensor, dweight: torch.Tensor, score: str,
                          normalize: bool, scaling_factor: float) -> torch.Tensor:
    """d loss / d logits [T, E] (logits' dtype) of topk_weights(scores_of(logits)) given dweight [T, K]:
    the chain rule written out (no nested autograd call), the reference of the Triton routing's backward
    kernel (moetrain.kernels.route.route_backward), which computes the same in one launch. s = the scores; with
    normalize, w_k = c s_k / S (S = sum of the chosen s, + 1e-20 for sigmoid), so
    dL/ds_k = c (g_k - sum_j g_j w_j / c) / S; then through sigmoid (s (1 - s)) or softmax."""
    scores = scores_of(logits, score)
    chosen = scores.gather(1, topk_idx)
    g = dweight.to(chosen.dtype) * scaling_factor
    if normalize:
        denom = chosen.sum(-1, keepdim=True)
        if score == "sigmoid":
            denom = denom + 1e-20
        g = (g - (g * chosen).sum(-1, keepdim=True) / denom) / denom
    if score == "sigmoid":
        dlogits = torch.zeros_like(scores).scatter_add_(1, topk_idx, g * chosen * (1 - chosen))
    else:
        dscores = torch.zeros_like(scores).scatter_add_(1, topk_idx, g)
        dlogits = scores * (dscores - (dscores * scores).sum(-1, keepdim=True))
    return dlogits.to(logits.dtype)


def route(logits: torch.Tensor, topk: int, *, score: str = "softmax", num_groups: int | None = None,
          topk_groups: int | None = None, group_score: str = "max", expert_bias: torch.Tensor | None = None,
          scaling_factor: float = 1.0, normalize: bool = True, impl: str = "torch",
          prob_sums: bool = False) -> Routing:
    """Route every token to its top-k experts (see the module docstring). logits [T, E] (any float
    dtype; computed in fp32 at least); expert_bias [E] fp32 or None; impl "torch", "triton" or "auto"
    (the Triton kernel on CUDA for fp32/bf16/fp16 logits when triton is installed, else PyTorch).
    prob_sums: also Routing.prob_sums, what the batch aux loss needs besides the counts (the kernel's
    column sums: no [T, E] scores to keep or recompute)."""
    E = logits.shape[1]
    _check(E, topk, score, num_groups, topk_groups, group_score, expert_bias, impl)
    if impl == "auto":
        impl = "triton" if _triton_routes(logits) else "torch"
    if impl == "triton":
        require_triton(logits.device)  # a one-line UserError without CUDA (or the interpreter) or triton
        idx, weight, counts, psum = _TritonRoute.apply(logits, topk, score, num_groups, topk_groups, group_score,
                                                       expert_bias, scaling_factor, normalize, prob_sums)
        return Routing(idx, weight, counts, None, psum)
    scores = scores_of(logits, score)
    sel = scores if expert_bias is None else scores + expert_bias
    if num_groups is not None:
        sel = sel.masked_fill(~group_limited_mask(sel, num_groups, topk_groups, group_score), float("-inf"))
    topk_idx = sel.topk(topk, dim=-1).indices
    weight = topk_weights(scores, topk_idx, score, normalize, scaling_factor)
    psum = aux_probs(scores, score).sum(0) if prob_sums else None
    return Routing(topk_idx, weight, expert_counts(topk_idx, E), scores, psum)


def aux_probs(scores: torch.Tensor, score: str) -> torch.Tensor:
    """[T, E] the aux loss's probabilities: softmax scores as they are, sigmoid scores divided by their sum."""
    return scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)


def _route_fake(logits, expert_bias, topk, score, num_groups, topk_groups, group_score, scaling_factor, normalize,
                prob_sums):
    T, E = logits.shape
    out = [logits.new_empty(T, topk, dtype=torch.int64), logits.new_empty(T, topk, dtype=torch.float32),
           logits.new_empty(E, dtype=torch.float32)]
    return out + [logits.new_empty(E, dtype=torch.float32)] if prob_sums else out


@kernel_op("route", fake=_route_fake)
def route_kernel(logits: torch.Tensor, expert_bias: torch.Tensor | None, topk: int, score: str,
                 num_groups: int | None, topk_groups: int | None, group_score: str, scaling_factor: float,
                 normalize: bool, prob_sums: bool) -> list[torch.Tensor]:
    """The routing kernel (kernels/route.py) as a custom op: [topk_idx [T, K] int64, topk_weight [T, K] fp32,
    counts [E] fp32], and prob_sums [E] fp32 after them when asked for."""
    # imports triton: only on this implementation
    from moetrain.kernels import route as kernels

    idx, weight, counts, psum = kernels.route(logits, topk, score, num_groups, topk_groups, group_score,
                                              expert_bias, scaling_factor, normalize, prob_sums)
    return [idx, weight, counts] + ([psum] if prob_sums else [])


def _route_backward_fake(logits, topk_idx, dweight, dpsum, score, normalize, scaling_factor):
    return logits.new_empty(logits.shape)


@kernel_op("route_backward", fake=_route_backward_fake)
def route_backward_kernel(logits: torch.Tensor, topk_idx: torch.Tensor, dweight: torch.Tensor | None,
                          dpsum: torch.Tensor | None, score: str, normalize: bool,
                          scaling_factor: float) -> torch.Tensor:
    """dlogits [T, E] in logits' dtype from dweight [T, K] and / or dpsum [E] (kernels/route.py's route_backward)."""
    from moetrain.kernels import route as kernels

    return kernels.route_backward(logits, topk_idx, dweight, score, normalize, scaling_factor, dpsum=dpsum)


class _TritonRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, score, num_groups, topk_groups, group_score, expert_bias, scaling_factor,
                normalize, prob_sums):
        idx, weight, counts, *psum = route_kernel(logits, expert_bias, topk, score, num_groups, topk_groups,
                                                  group_score, scaling_factor, normalize, prob_sums)
        ctx.save_for_backward(logits, idx)
        ctx.args = (score, normalize, scaling_factor)
        ctx.mark_non_differentiable(idx, counts)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for idx and counts (a kernel each)
        return idx, weight, counts, psum[0] if psum else None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _didx, dweight, _dcounts, dpsum):
        if dweight is None and dpsum is None:
            return (None,) * 10
        logits, idx = ctx.saved_tensors
        dlogits = route_backward_kernel(logits, idx, dweight, dpsum, *ctx.args)
        return dlogits, None, None, None, None, None, None, None, None, None


def _triton_routes(logits: torch.Tensor) -> bool:
    """auto's choice (runtime.expert_plan's routing rule): the kernel wherever it runs natively; fp64 stays on
    PyTorch, and so does a layer under torch.compile, which fuses the PyTorch routing itself. impl="triton" runs
    the kernel compiled too, as a custom op."""
    return plan_for(logits).routing == "triton"


def _check(E, topk, score, num_groups, topk_groups, group_score, expert_bias, impl) -> None:
    if score not in SCORES:
        raise ValueError(f"unknown score function {score!r}; valid: {', '.join(SCORES)}")
    if impl not in ("torch", "triton", "auto"):
        raise ValueError(f"unknown routing implementation {impl!r}; valid: torch, triton, auto")
    if not 1 <= topk <= E:
        raise ValueError(f"route: topk={topk} must be in 1..E={E}")
    if num_groups is not None:
        if E % num_groups or topk_groups is None or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"route: num_groups={num_groups} must divide E={E} and topk_groups={topk_groups} "
                             f"be in 1..num_groups")
        if group_score not in GROUP_SCORES:
            raise ValueError(f"unknown group score {group_score!r}; valid: {', '.join(GROUP_SCORES)}")
        if topk > topk_groups * (E // num_groups):
            raise ValueError(f"route: topk={topk} exceeds the experts of {topk_groups} groups of {E // num_groups}")
    if expert_bias is not None and expert_bias.shape != (E,):
        raise ValueError(f"route: expert_bias {tuple(expert_bias.shape)} must be [E] = [{E}]")
