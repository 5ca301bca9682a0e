"""Routed experts on JAX arrays: dispatch -> grouped FC1 -> activation -> grouped FC2 -> combine, sync-free under jit.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M = T * K routed rows.

``moe_experts(x [T, H], topk_idx [T, K], topk_weight [T, K], w1 [E, 2I, H], w2 [E, H, I], b1 [E, 2I] | None,
b2 [E, H] | None, activation)`` -> [T, H] in x's dtype: sum_k topk_weight[t, k] * FFN_{topk_idx[t, k]}(x[t]) with
FFN_e(x) = w2[e] @ act(w1[e] @ x + b1[e]) + b2[e] (w1 rows 0..I-1 gate, I..2I-1 up), the torch side's
``ops.moe_experts``. Assignments with idx -1 (dropped by a capacity) contribute nothing.

Every shape is static: the M assignments are sorted by expert (dropped ones last, as zero rows), the group sizes
stay on the device, the GEMMs are ``grouped_gemm`` over all M rows, and the combine is one scatter-add by token.
Nothing reads the routing on the host, so one compiled step serves every batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetrain.jax.grouped_gemm import grouped_gemm
from moetrain.jax.ops import gated_activation


def sort_by_expert(topk_idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(order [M] int32: the flat assignment t*K + k in row order, expert [M] int32 of each row (E for dropped
    ones, sorted last), group_sizes [E] int32)."""
    flat = topk_idx.reshape(-1)
    key = jnp.where(flat >= 0, flat, num_experts).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    expert = key[order]
    group_sizes = jnp.zeros(num_experts, jnp.int32).at[key].add(1, mode="drop")
    return order, expert, group_sizes


def moe_experts(x: jax.Array, topk_idx: jax.Array, topk_weight: jax.Array, w1: jax.Array, w2: jax.Array,
                b1: jax.Array | None = None, b2: jax.Array | None = None, activation: str = "swiglu") -> jax.Array:
    T, K = topk_idx.shape
    E = w1.shape[0]
    order, expert, group_sizes = sort_by_expert(topk_idx, E)
    token = order // K
    kept = expert < E
    rows = jnp.where(kept[:, None], x[token], 0).astype(x.dtype)  # [M, H]; dropped rows are zeros
    bias_expert = jnp.minimum(expert, E - 1)  # a dropped row's bias is any expert's: its weight is 0
    h = grouped_gemm(rows, w1, group_sizes)  # [M, 2I]
    if b1 is not None:
        h = h + b1[bias_expert].astype(h.dtype)
    gate, up = jnp.split(h, 2, axis=-1)
    y = grouped_gemm(gated_activation(gate, up, activation).astype(x.dtype), w2, group_sizes)  # [M, H]
    if b2 is not None:
        y = y + b2[bias_expert].astype(y.dtype)
    weight = jnp.where(kept, topk_weight.reshape(-1)[order], 0.0)  # fp32
    weighted = (y.astype(weight.dtype) * weight[:, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(weighted)
