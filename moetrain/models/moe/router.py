"""MoE router: scores, (group-limited) top-k, expert bias, capacity, aux and z losses.

Legend: T tokens, H hidden, E experts, K top-k, G expert groups, B sequences, S tokens per
sequence (T = B * S).

Everything here is sync-free: no .item()/.tolist()/.cpu(); shapes depend only on T, E, K (the
capacity is computed from shapes on the host), token counts stay on the device.

Pipeline (scores in fp32 throughout):
1. logits = x @ weight^T (+ router bias), computed in fp32. force_balance=uniform replaces the
   logits used for routing by standard-normal noise (the aux/z losses still see the real ones).
2. scores = softmax(logits) or sigmoid(logits).
3. selection scores = scores + expert_bias (aux-loss-free balancing; the bias only affects
   which experts are chosen, never the weights). Group-limited routing ranks the G groups of
   E/G consecutive experts by max or top-2-sum of their selection scores, keeps the best
   topk_groups per token and masks the other groups' experts to -inf; then top-k.
4. weights = unbiased scores of the chosen experts; with normalize_topk divided by their sum
   (softmax: renormalised top-k; sigmoid: normalised over the selected, + 1e-20 as DeepSeek);
   then times scaling_factor. force_balance=even skips 1-4: token t takes experts
   (t*K + k) % E with weight 1/K.
5. Capacity (capacity_factor set): C = ceil(factor * T * K / E) assignments per expert. Within
   each expert the assignments are ranked by routing weight, highest first, ties by flat
   position t*K + k (earlier tokens first); those ranked >= C are dropped: topk_idx = -1,
   weight 0. So the lowest-weight assignments are dropped first.
6. counts[e] = assignments to e before dropping (the demand; this is what the expert-bias
   update and load-imbalance metric use).

Losses (unweighted unless the caller passes aux_scale / z_scale: the MoE layer passes its coefficients):
* aux (Switch/GShard/DeepSeek): E * sum_e f_e * P_e, f_e = fraction of the T*K assignments
  that went to e (before dropping), P_e = mean over tokens of the token's score for e,
  normalised to sum to 1 over experts (sigmoid scores are divided by their sum). Balanced
  routing gives 1. "batch": over all T tokens; "sequence": per sequence, averaged over B.
  The batch loss takes f and P from the routing itself (ops.route's counts and prob_sums: with the
  Triton routing, one kernel each way, no [T, E] scores recomputed in PyTorch).
* z: mean over tokens of logsumexp(logits)^2.

Token split (tensor parallelism; ``Router.token_split``, None on one device, set from outside by
``distributed.tensor_parallel``): the ranks of a group each route their own slice of every sequence (x is this rank's
[B * seq_len] tokens, seq_len its positions per sequence), and the losses must be the whole batch's. The object
gives ``parts`` (ranks sharing each sequence; the whole sequence is seq_len * parts) and ``sum_(t)`` (sums a tensor
over those ranks in place, no gradient). One such sum per layer brings the assignment counts (per sequence for the
sequence loss), the probability sums and the z sum: each rank's losses are then its part of the whole ones,
E * sum_e f_e (whole batch) * (this rank's probability sum_e) / (whole token count) and this rank's
sum of logsumexp^2 / (whole token count), so the parts sum over the ranks to the single-device losses and their
gradients to its gradient. ``RouterOutput.whole`` holds the whole weighted losses (detached, the same on every
rank) for logging. ``counts`` stay this rank's (the trainer sums them over the ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from moetrain.ops.route import aux_probs, expert_counts, group_limited_mask, route, scores_of  # noqa: F401 (re-exported)
from moetrain.ops.router_gemm import router_logits
from moetrain.runtime.expert_plan import plan_for


_ZEROS: dict = {}  # (device, dtype) -> a 0-dim zero, never written


def zero_loss(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A shared 0-dim zero for a loss that is off (read-only: nothing may write into it). Made once per device and
    dtype: a new one per layer call was an allocation and a fill kernel, ~50-80 us of host time each on the H200
    host, for every MoE layer without a z loss and every dense layer. Inside torch.compile, a fresh one (a global
    cache of tensors would be traced); so too while a CUDA graph is captured before one was made (its fill would
    only run at the graph's replay, and its memory would come from the graph's pool)."""
    if torch.compiler.is_compiling():
        return torch.zeros((), device=device, dtype=dtype)
    key = (device, dtype)
    zero = _ZEROS.get(key)
    if zero is not None:
        return zero
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros((), device=device, dtype=dtype)
    zero = _ZEROS[key] = torch.zeros((), device=device, dtype=dtype)
    return zero


@dataclass
class RouterOutput:
    topk_idx: torch.Tensor  # [T, K] int64; -1 = dropped by capacity
    topk_weight: torch.Tensor  # [T, K] fp32 (fp64 for fp64 inputs); 0 where dropped
    counts: torch.Tensor  # [E] fp32, assignments per expert before dropping
    aux_loss: torch.Tensor  # fp32 scalar, times aux_scale; a shared zero (zero_loss) when moe.aux_loss_coeff == 0
    z_loss: torch.Tensor  # fp32 scalar, times z_scale; a shared zero (zero_loss) when moe.z_loss_coeff == 0
    logits: torch.Tensor  # [T, E] router logits, fp32 (fp64 for fp64 inputs)
    # with a token split: fp32 [] detached, the whole batch's weighted aux + z (aux_loss and z_loss are this rank's
    # parts of it); None without one
    whole: torch.Tensor | None = None


def drop_over_capacity(topk_idx: torch.Tensor, topk_weight: torch.Tensor, capacity: int,
                       num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity`` assignments per expert, highest weight first (ties: lower flat
    position t*K + k first). Dropped ones get idx -1 and weight 0. Sync-free (two stable sorts)."""
    flat_e = topk_idx.reshape(-1)
    flat_w = topk_weight.reshape(-1)
    n = flat_e.numel()
    by_weight = torch.argsort(-flat_w, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]  # by expert, then weight desc
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_e.device)
    counts.scatter_add_(0, flat_e, torch.ones_like(flat_e))
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(n, device=flat_e.device) - starts[flat_e[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    keep = (rank < capacity).view_as(topk_idx)
    return (torch.where(keep, topk_idx, torch.full_like(topk_idx, -1)),
            torch.where(keep, topk_weight, torch.zeros_like(topk_weight)))


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                        seq_len: int | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """E * sum_e f_e * P_e (see module doc). probs [T, E] rows summing to 1; topk_idx [T, K] >= 0.
    seq_len given: per-sequence loss (T = B * seq_len) averaged over sequences. counts [E] fp32 (optional): the
    assignments per expert of topk_idx, as the routing returns them (the batch loss then does not count again)."""
    T, K = topk_idx.shape
    E = num_experts
    if seq_len is None:
        f = (expert_counts(topk_idx, E) if counts is None else counts) / (T * K)
        return E * (f * probs.mean(0)).sum()
    B = T // seq_len
    onehot = torch.zeros(T, E, device=probs.device, dtype=probs.dtype).scatter_(1, topk_idx, 1.0)
    f = onehot.view(B, seq_len, E).sum(1) / (seq_len * K)  # [B, E]
    p = probs.view(B, seq_len, E).mean(1)  # [B, E]
    return E * (f * p).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE), fp32."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class Router(nn.Module):
    """Parameters: weight [E, H], bias [E] (moe.router_bias). Buffer: expert_bias [E] fp32
    (moe.expert_bias), kept in fp32 even when the model is cast to bf16."""

    def __init__(self, cfg):
        super().__init__()
        e = cfg.moe
        self.num_experts, self.topk = e.num_experts, e.topk
        self.score_function = e.score_function
        self.num_groups, self.topk_groups, self.group_score = e.num_groups, e.topk_groups, e.group_score
        self.normalize_topk, self.scaling_factor = e.normalize_topk, e.scaling_factor
        self.capacity_factor = e.capacity_factor
        self.force_balance = e.force_balance
        self.aux_loss_type = e.aux_loss_type
        self.compute_aux = e.aux_loss_coeff > 0
        self.compute_z = e.z_loss_coeff > 0
        self.backend, self.router_gemm = e.backend, e.router_gemm  # (runtime.expert_plan picks the kernels)
        self.weight = nn.Parameter(torch.empty(e.num_experts, cfg.model.hidden_size))
        self.bias = nn.Parameter(torch.empty(e.num_experts)) if e.router_bias else None
        if e.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.token_split = None  # set by tensor parallelism (see the module doc)

    def _apply(self, fn, recurse=True):
        # model.to(bf16) would round the expert bias (updates of 1e-3 vanish in bf16): keep fp32.
        saved = self.expert_bias
        super()._apply(fn, recurse)
        if saved is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = saved.to(device=self.expert_bias.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor, seq_len: int | None = None, aux_scale: float = 1.0,
                z_scale: float = 1.0) -> RouterOutput:
        """x [T, H] -> RouterOutput. seq_len: tokens per sequence (for aux_loss_type=sequence). aux_scale, z_scale:
        factors on the aux and z losses (the MoE layer passes its coefficients: the batch aux loss then takes its
        coefficient inside the one scalar multiply it has anyway, a kernel fewer forward and backward per layer)."""
        T, E, K = x.shape[0], self.num_experts, self.topk
        # fp32 routing (fp64 when the model runs in fp64, e.g. reference tests)
        dt = torch.promote_types(x.dtype, torch.float32)
        plan = plan_for(x, self.backend, self.router_gemm)
        logits = router_logits(x, self.weight, self.bias, impl=plan.logits)  # [T, E] fp32 (fp64)

        scores = prob_sums = None
        if self.force_balance == "even":
            t = torch.arange(T, device=x.device).unsqueeze(1)
            topk_idx = (t * K + torch.arange(K, device=x.device)) % E
            topk_weight = torch.full((T, K), 1.0 / K, device=x.device, dtype=dt)
            counts = expert_counts(topk_idx, E)
        else:
            route_logits = logits
            if self.force_balance == "uniform":  # random routing; the losses still see the real logits
                route_logits = torch.randn(T, E, device=x.device, dtype=dt)
            elif self.force_balance != "none":
                raise ValueError(f"unknown moe.force_balance {self.force_balance!r}; valid: none, even, uniform")
            # The batch aux loss from the routing's own statistics (no [T, E] scores recomputed), when the
            # routing saw the real logits
            batch_aux = self.compute_aux and self.aux_loss_type != "sequence" and self.force_balance == "none"
            r = route(route_logits, K, score=self.score_function, num_groups=self.num_groups,
                      topk_groups=self.topk_groups, group_score=self.group_score, expert_bias=self.expert_bias,
                      scaling_factor=self.scaling_factor, normalize=self.normalize_topk, impl=plan.routing,
                      prob_sums=batch_aux)
            topk_idx, topk_weight, counts = r.topk_idx, r.topk_weight, r.counts
            if self.force_balance == "none":
                scores = r.scores
            if batch_aux:
                prob_sums = r.prob_sums

        whole = None
        if self.token_split is not None:
            aux, z, whole = self._split_losses(logits, scores, prob_sums, topk_idx, counts, seq_len, aux_scale, z_scale)
        else:
            aux, z = self._losses(logits, scores, prob_sums, topk_idx, counts, seq_len, aux_scale, z_scale)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * T * K / E)
            topk_idx, topk_weight = drop_over_capacity(topk_idx, topk_weight, capacity, E)
        return RouterOutput(topk_idx, topk_weight, counts, aux, z, logits, whole)

    def _losses(self, logits, scores, prob_sums, topk_idx, counts, seq_len, aux_scale, z_scale):
        """(aux, z) of this rank's tokens, weighted; each the shared zero when off."""
        T, E, K = logits.shape[0], self.num_experts, self.topk
        zero = zero_loss(logits.device, logits.dtype)
        aux = zero
        if prob_sums is not None:  # E * sum_e f_e * P_e with P_e = prob_sums_e / T (load_balancing_loss's batch form)
            aux = torch.dot(counts.to(prob_sums.dtype), prob_sums) * (aux_scale * E / (T * K * T))
        elif self.compute_aux:
            scores = scores if scores is not None else scores_of(logits, self.score_function)
            probs = aux_probs(scores, self.score_function)
            per_seq = seq_len if self.aux_loss_type == "sequence" else None
            # the routing's counts (before capacity dropping, as the loss wants): counting again was ~5 more ops
            aux = load_balancing_loss(probs, topk_idx, E, per_seq, counts=counts.to(probs.dtype))
            aux = aux if aux_scale == 1.0 else aux * aux_scale
        z = zero
        if self.compute_z:
            z = router_z_loss(logits)
            z = z if z_scale == 1.0 else z * z_scale
        return aux, z

    def _split_losses(self, logits, scores, prob_sums, topk_idx, counts, seq_len, aux_scale, z_scale):
        """(aux, z, whole) under a token split (module doc): this rank's parts of the whole batch's weighted losses
        (with grad) and the whole weighted aux + z (detached). One ``token_split.sum_`` of [G*E counts | G*E
        probability sums | z sum]: G = B sequences (sequence loss) or 1 (batch loss)."""
        split, (T, E), K = self.token_split, logits.shape, self.topk
        zero = zero_loss(logits.device, logits.dtype)
        local, G = [], 1
        if self.compute_aux:
            per_seq = self.aux_loss_type == "sequence"
            G = T // seq_len if per_seq else 1
            if prob_sums is None:  # the batch loss without the routing's sums, or the sequence loss
                scores = scores if scores is not None else scores_of(logits, self.score_function)
                prob_sums = aux_probs(scores, self.score_function).view(G, T // G, E).sum(1)  # [G, E]
            if per_seq:
                onehot = torch.zeros(T, E, device=logits.device, dtype=prob_sums.dtype).scatter_(1, topk_idx, 1.0)
                group_counts = onehot.view(G, T // G, E).sum(1)
            else:
                group_counts = counts
            prob_sums = prob_sums.view(G, E)
            local += [group_counts.reshape(-1).to(prob_sums.dtype), prob_sums.detach().reshape(-1)]
        if self.compute_z:
            z_sum = torch.logsumexp(logits.float(), dim=-1).square().sum()
            local.append(z_sum.detach().reshape(1).to(local[0].dtype if local else z_sum.dtype))
        if not local:
            return zero, zero, zero
        stats = split.sum_(torch.cat(local))
        tokens = T * split.parts  # the whole batch's tokens; each group (sequence or batch) has tokens / G
        aux = z = zero
        whole = zero.new_zeros(())
        if self.compute_aux:
            group_counts, whole_sums = stats[:G * E].view(G, E), stats[G * E:2 * G * E].view(G, E)
            n = tokens // G
            factor = aux_scale * E / (n * K * n)
            aux = factor * (group_counts * prob_sums).sum(-1).mean()
            whole = whole + factor * (group_counts * whole_sums).sum(-1).mean()
        if self.compute_z:
            z = z_sum * (z_scale / tokens)
            whole = whole + stats[-1] * (z_scale / tokens)
        return aux, z, whole.detach().float()
