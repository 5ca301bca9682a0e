"""Top-k routing and the balancing losses in JAX: the functions of the torch side's ``ops.route`` and
``models.moe.router`` (their docstrings hold the full definitions), sync-free under jit.

Legend: T tokens, E experts, K top-k, G expert groups, B sequences of S tokens (T = B * S).

``route(logits [T, E], ...)`` -> (topk_idx [T, K] int32, topk_weight [T, K], counts [E] fp32, scores [T, E]):
scores = softmax or sigmoid of the fp32 logits; selection = scores + expert_bias, restricted to the best
topk_groups groups (ranked by max or top-2 sum); the K best selectable experts; their unbiased scores as weights
(normalised: sigmoid + 1e-20), times scaling_factor. Gradients reach the logits through the weights only.
``balancing_loss`` and ``z_loss`` are the unweighted losses; ``drop_over_capacity`` keeps the highest-weight
assignments of each expert (ties: earlier flat position first).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def scores_of(logits: jax.Array, score: str) -> jax.Array:
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if score == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if score == "sigmoid":
        return jax.nn.sigmoid(logits)
    raise ValueError(f"unknown score function {score!r}; valid: softmax, sigmoid")


def group_limited_mask(sel: jax.Array, num_groups: int, topk_groups: int, group_score: str) -> jax.Array:
    """[T, E] bool: the experts of each token's topk_groups best groups."""
    T, E = sel.shape
    grouped = sel.reshape(T, num_groups, E // num_groups)
    if group_score == "max":
        gscore = grouped.max(axis=-1)
    elif group_score == "top2_sum":
        gscore = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
    else:
        raise ValueError(f"unknown group score {group_score!r}; valid: max, top2_sum")
    best = jax.lax.top_k(gscore, topk_groups)[1]  # [T, topk_groups]
    gmask = jnp.zeros((T, num_groups), bool).at[jnp.arange(T)[:, None], best].set(True)
    return jnp.repeat(gmask, E // num_groups, axis=1)


def expert_counts(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """[E] fp32 assignments per expert; entries < 0 (dropped) are not counted."""
    flat = topk_idx.reshape(-1)
    return jnp.zeros(num_experts, jnp.float32).at[jnp.maximum(flat, 0)].add((flat >= 0).astype(jnp.float32))


def route(logits: jax.Array, topk: int, *, score: str = "softmax", num_groups: int | None = None,
          topk_groups: int | None = None, group_score: str = "max", expert_bias: jax.Array | None = None,
          scaling_factor: float = 1.0, normalize: bool = True):
    E = logits.shape[1]
    scores = scores_of(logits, score)
    sel = scores if expert_bias is None else scores + expert_bias
    sel = jax.lax.stop_gradient(sel)  # the selection picks; only the weights carry a gradient
    if num_groups is not None:
        sel = jnp.where(group_limited_mask(sel, num_groups, topk_groups, group_score), sel, -jnp.inf)
    topk_idx = jax.lax.top_k(sel, topk)[1]
    weight = jnp.take_along_axis(scores, topk_idx, axis=1)
    if normalize:
        denom = weight.sum(-1, keepdims=True)
        weight = weight / (denom + 1e-20 if score == "sigmoid" else denom)
    return topk_idx, weight * scaling_factor, expert_counts(topk_idx, E), scores


def aux_probs(scores: jax.Array, score: str) -> jax.Array:
    """The aux loss's probabilities: softmax scores as they are, sigmoid scores over their sum."""
    return scores if score == "softmax" else scores / scores.sum(-1, keepdims=True)


def balancing_loss(probs: jax.Array, topk_idx: jax.Array, num_experts: int, seq_len: int | None = None) -> jax.Array:
    """E * sum_e f_e * P_e over the batch (seq_len None) or per sequence averaged over sequences."""
    T, K = topk_idx.shape
    E = num_experts
    if seq_len is None:
        f = expert_counts(topk_idx, E) / (T * K)
        return E * jnp.sum(f * probs.mean(0))
    B = T // seq_len
    onehot = jnp.zeros((T, E), probs.dtype).at[jnp.arange(T)[:, None], topk_idx].set(1.0)
    f = onehot.reshape(B, seq_len, E).sum(1) / (seq_len * K)
    p = probs.reshape(B, seq_len, E).mean(1)
    return E * jnp.mean(jnp.sum(f * p, axis=-1))


def z_loss(logits: jax.Array) -> jax.Array:
    """mean_t logsumexp(logits_t)^2, fp32."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


def capacity(capacity_factor: float, tokens: int, topk: int, num_experts: int) -> int:
    return math.ceil(capacity_factor * tokens * topk / num_experts)


def drop_over_capacity(topk_idx: jax.Array, topk_weight: jax.Array, cap: int,
                       num_experts: int) -> tuple[jax.Array, jax.Array]:
    """At most ``cap`` assignments per expert, highest weight first; the rest get idx -1 and weight 0."""
    flat_e = topk_idx.reshape(-1)
    flat_w = jax.lax.stop_gradient(topk_weight).reshape(-1)
    n = flat_e.shape[0]
    by_weight = jnp.argsort(-flat_w, stable=True)
    order = by_weight[jnp.argsort(flat_e[by_weight], stable=True)]
    counts = jnp.zeros(num_experts, jnp.int32).at[flat_e].add(1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n) - starts[flat_e[order]]
    rank = jnp.zeros(n, rank_sorted.dtype).at[order].set(rank_sorted)
    keep = (rank < cap).reshape(topk_idx.shape)
    return jnp.where(keep, topk_idx, -1), jnp.where(keep, topk_weight, 0.0)
