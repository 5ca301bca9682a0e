"""Expert parallelism for the JAX model: routed experts sharded over a mesh axis, tokens exchanged by all-to-all
with static worst-case buffers, sync-free under jit.

Legend: T tokens on one device, H hidden, E experts in all, EL = E / ep experts per device, K top-k,
C = T * min(K, EL) rows a device may send to one peer (a token's K experts are distinct, so at most min(K, EL) of
them live on one peer: nothing is dropped), or fewer with moe.dispatcher_capacity (``peer_rows``): rows past it
are dropped, as the torch side's sync-free dispatcher drops them.

``apply_expert_parallel(model, mesh, axis="ep")`` shards every MoE layer's w1/w2/b1/b2 on their expert dim over
``axis`` and makes the layers run ``moe_experts_ep``; the rest of the model stays as written (single-device code)
and GSPMD shards it by its inputs: the batch split over the same axis is data parallelism, and the replicated
weights' gradients are summed over it by XLA.

``moe_experts_ep`` (inside ``jax.shard_map`` over ``axis``; per device x [T, H], topk_idx/topk_weight [T, K],
w1 [EL, 2I, H], w2 [EL, H, I]) computes what ``moe.moe_experts`` computes on the whole batch:
1. each assignment (t, k) gets its owner device e // EL and a slot in that device's send buffer [ep, C, H]
   (its rank among this device's assignments to the same owner);
2. ``all_to_all`` sends the buffers (and each row's local expert id, -1 for an empty slot);
3. the owner runs its experts on the [ep * C, H] received rows (``moe_experts`` with one "expert choice" per
   row and weight 1: empty slots contribute nothing);
4. ``all_to_all`` returns the rows, and each device sums its tokens' K results, weighted.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moetrain.jax.moe import moe_experts


def send_slots(owner: jax.Array, ep: int) -> jax.Array:
    """[M] the slot of each assignment in its owner's send buffer: how many earlier assignments (flat order) go to
    the same owner."""
    onehot = jax.nn.one_hot(owner, ep, dtype=jnp.int32)  # [M, ep]
    return jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, owner[:, None], axis=1)[:, 0]


def peer_rows(T: int, K: int, EL: int, ep: int, capacity: float | None) -> int:
    """C: the worst case T * min(K, EL), or with ``capacity`` (moe.dispatcher_capacity) that factor of the even
    share T * K / ep, whichever is smaller."""
    worst = T * min(K, EL)
    return worst if capacity is None else max(1, min(worst, math.ceil(capacity * T * K / ep)))


def moe_experts_ep(x, topk_idx, topk_weight, w1, w2, b1=None, b2=None, *, activation: str, axis: str, ep: int,
                   capacity: float | None = None, data_axes: tuple = ()):
    if data_axes:  # experts replicated over the data axes: made varying there, so their gradient sums over them
        w1, w2, b1, b2 = (None if w is None else jax.lax.pcast(w, data_axes, to="varying") for w in (w1, w2, b1, b2))
    T, H = x.shape
    K = topk_idx.shape[1]
    EL = w1.shape[0]
    C = peer_rows(T, K, EL, ep, capacity)  # rows past C to one peer are dropped (contribute 0)
    flat = topk_idx.reshape(-1)  # [M]; -1 = dropped by a capacity
    kept = flat >= 0
    owner = jnp.where(kept, flat // EL, 0)
    slot = jnp.where(kept, send_slots(owner, ep), C)  # C: out of bounds, dropped by the scatter
    token = jnp.arange(T * K) // K
    send = jnp.zeros((ep, C, H), x.dtype).at[owner, slot].set(x[token], mode="drop")
    send_expert = jnp.full((ep, C), -1, jnp.int32).at[owner, slot].set((flat % EL).astype(jnp.int32), mode="drop")
    recv = jax.lax.all_to_all(send, axis, 0, 0)
    recv_expert = jax.lax.all_to_all(send_expert, axis, 0, 0)
    ones = jnp.ones((ep * C, 1), jnp.float32)
    y = moe_experts(recv.reshape(ep * C, H), recv_expert.reshape(ep * C, 1), ones, w1, w2, b1, b2, activation)
    back = jax.lax.all_to_all(y.reshape(ep, C, H), axis, 0, 0)  # [ep, C, H]: row (owner, slot) of each assignment
    rows = back.at[owner, slot].get(mode="fill", fill_value=0)  # [M, H]
    weight = jnp.where(kept, topk_weight.reshape(-1), 0.0)
    weighted = (rows.astype(weight.dtype) * weight[:, None]).astype(x.dtype)
    return jnp.zeros_like(x).at[token].add(weighted)


def sharded_moe_experts(mesh: Mesh, axis: str, activation: str, capacity: float | None = None):
    """``moe_experts``'s signature, run as ``moe_experts_ep`` under ``shard_map``: the tokens split over every axis
    of ``mesh`` (the data ranks), the experts over ``axis`` and exchanged over it (absent biases are None)."""
    data_axes = tuple(a for a in mesh.axis_names if a != axis)
    fn = partial(moe_experts_ep, activation=activation, axis=axis, ep=mesh.shape[axis], capacity=capacity,
                 data_axes=data_axes)
    tokens, experts = P(tuple(mesh.axis_names)), P(axis)
    return jax.shard_map(fn, mesh=mesh, in_specs=(tokens,) * 3 + (experts,) * 4, out_specs=tokens)


def apply_expert_parallel(model, mesh: Mesh, axis: str = "ep") -> None:
    """Shard every MoE layer's routed experts of ``model`` (moetrain.jax.model.MoETransformer) over ``axis`` of
    ``mesh`` and run them with all-to-all dispatch, each device's rows to one peer bounded by
    moe.dispatcher_capacity (null: the worst case, nothing dropped). The number of experts must divide by the axis
    size; the tokens of each MoE call (batch x sequence) must too."""
    ep = mesh.shape[axis]
    E = model.cfg.moe.num_experts
    if E % ep:
        raise ValueError(f"expert parallelism over {ep} devices: moe.num_experts = {E} must divide by it")
    for layer in model.moe_layers():
        experts = layer.experts
        for name in ("w1", "w2", "b1", "b2"):
            var = getattr(experts, name)
            if var is not None:
                var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, P(axis))))
        experts.parallel_fn = sharded_moe_experts(mesh, axis, experts.activation, model.cfg.moe.dispatcher_capacity)
