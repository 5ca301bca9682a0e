"""The MoE transformer in Flax NNX: the torch ``models.transformer.MoETransformer`` module for module, name for name.

Legend: B batch, S sequence, H hidden, V vocab, E experts, K top-k.

Why NNX (not linen): its modules are Python objects holding their parameters, so the tree is the torch model's
tree (``layers.3.attn.q_proj.weight`` is the same path on both sides) and weights interchange by name
(``moetrain.jax.convert``); training code splits it into a pure (graphdef, state) pair for jit and optax.

Contract: ``MoETransformer(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32)``; ``model(input_ids [B, S] int)`` ->
logits [B, S, V] in the parameter dtype; ``model(input_ids, labels)`` -> ``Losses`` (labels[b, i] = the token
after input_ids[b, i], -100 ignored). The loss is lm + the MoE blocks' weighted balancing losses + mtp_loss_scale
* the MTP depths' mean loss, as on the torch side; its gradient is the torch model's.

Every Linear keeps torch's [out, in] weight; routers compute their logits in fp32; the expert bias and the
per-expert assignment counts are ``Buffer`` variables (not trained): ``tokens_per_expert`` accumulates the counts
of each forward while ``MoELayer.counting`` is on. Recompute (train.recompute): "full" checkpoints each block,
"selective" the attention core and the routed experts; train.recompute_layer_ids get "full".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.jax import ops
from moetrain.jax import routing
from moetrain.jax.moe import moe_experts
from moetrain.models.rope import RopeParams


class Buffer(nnx.Variable):
    """State that is not trained (the expert bias, load counts): optimizers and gradients skip it."""


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


class Linear(nnx.Module):
    """y [..., out] = x [..., in] @ weight.T (+ bias); weight [out, in] as torch."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, std: float, dtype, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (d_out, d_in), std, dtype)
        self.bias = nnx.Param(jnp.zeros(d_out, dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.weight[...].T
        return y if self.bias is None else y + self.bias[...]


class Embedding(nnx.Module):
    """out [..., H] = weight[ids]; weight [V, H]."""

    def __init__(self, V: int, H: int, *, std: float, dtype, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (V, H), std, dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.weight[...][ids]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones(dim, dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return ops.rms_norm(x, self.weight[...], self.eps)


class MLP(nnx.Module):
    """gate_proj/up_proj [F, H], down_proj [H, F]; gelu has no gate."""

    def __init__(self, H: int, F: int, activation: str, *, std: float, dtype, rngs: nnx.Rngs):
        self.activation = activation
        self.gate_proj = None if activation == "gelu" else Linear(H, F, std=std, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(H, F, std=std, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(F, H, std=std, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_proj is None:
            return self.down_proj(jax.nn.gelu(self.up_proj(x), approximate=False))
        return self.down_proj(ops.gated_activation(self.gate_proj(x), self.up_proj(x), self.activation))


class _Attention(nnx.Module):
    def core(self, q, k, v, sinks=None):
        fn = partial(ops.attention_core, scale=self.scale, window=self.window)
        if self.recompute_core:
            fn = jax.checkpoint(fn)
        return fn(q, k, v, sinks=sinks)


class GQAAttention(_Attention):
    def __init__(self, cfg, window: int | None, *, dtype, rngs: nnx.Rngs):
        m = cfg.model
        H, nh, nkv, hd, std = m.hidden_size, m.num_attention_heads, cfg.kv_heads, cfg.attn_head_dim, m.init_std
        self.hd, self.window, self.recompute_core = hd, window, False
        out_bias = m.attention_bias if m.attention_out_bias is None else m.attention_out_bias
        lin = partial(Linear, std=std, dtype=dtype, rngs=rngs)
        self.q_proj = lin(H, nh * hd, bias=m.attention_bias)
        self.k_proj = lin(H, nkv * hd, bias=m.attention_bias)
        self.v_proj = lin(H, nkv * hd, bias=m.attention_bias)
        self.o_proj = lin(nh * hd, H, bias=out_bias)
        self.q_norm = RMSNorm(hd, m.norm_eps, dtype) if m.qk_norm else None
        self.k_norm = RMSNorm(hd, m.norm_eps, dtype) if m.qk_norm else None
        self.sinks = _normal(rngs, (nh,), std, dtype) if m.attention_sinks else None
        self.scale = hd ** -0.5 * RopeParams.from_model_config(m, hd).softmax_scale_multiplier

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        B, S, _ = x.shape
        q = self.q_proj(x).reshape(B, S, -1, self.hd)
        k = self.k_proj(x).reshape(B, S, -1, self.hd)
        v = self.v_proj(x).reshape(B, S, -1, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        sinks = None if self.sinks is None else self.sinks[...]
        o = self.core(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), sinks)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, S, -1))


class MLAttention(_Attention):
    """DeepSeek multi-head latent attention (models.attention.MLAttention)."""

    def __init__(self, cfg, window: int | None, *, dtype, rngs: nnx.Rngs):
        m = cfg.model
        H, nh = m.hidden_size, m.num_attention_heads
        self.nope, self.rope_dim, self.dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kvl = m.kv_lora_rank
        self.window, self.recompute_core = window, False
        qk = self.nope + self.rope_dim
        lin = partial(Linear, std=m.init_std, dtype=dtype, rngs=rngs)
        if m.q_lora_rank:
            self.q_a_proj = lin(H, m.q_lora_rank)
            self.q_a_norm = RMSNorm(m.q_lora_rank, m.norm_eps, dtype)
            self.q_b_proj = lin(m.q_lora_rank, nh * qk)
            self.q_proj = None
        else:
            self.q_proj = lin(H, nh * qk)
        self.kv_a_proj = lin(H, self.kvl + self.rope_dim)
        self.kv_a_norm = RMSNorm(self.kvl, m.norm_eps, dtype)
        self.kv_b_proj = lin(self.kvl, nh * (self.nope + self.dv))
        self.o_proj = lin(nh * self.dv, H)
        self.scale = qk ** -0.5 * RopeParams.from_model_config(m, self.rope_dim).softmax_scale_multiplier

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        B, S, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.reshape(B, S, -1, self.nope + self.rope_dim)
        q_nope, q_rope = q[..., :self.nope], q[..., self.nope:]
        ckv = self.kv_a_proj(x)
        c, k_rope = ckv[..., :self.kvl], ckv[..., self.kvl:]
        kv = self.kv_b_proj(self.kv_a_norm(c)).reshape(B, S, -1, self.nope + self.dv)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        q_rope = ops.apply_rope(q_rope, cos, sin)
        k_rope = jnp.broadcast_to(ops.apply_rope(k_rope[:, :, None, :], cos, sin), q_rope.shape)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        o = self.core(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, S, -1))


class Router(nnx.Module):
    """weight [E, H], bias [E] (moe.router_bias), expert_bias [E] fp32 Buffer (moe.expert_bias)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        e = cfg.moe
        self.e = e
        self.weight = _normal(rngs, (e.num_experts, cfg.model.hidden_size), cfg.model.init_std, dtype)
        self.bias = nnx.Param(jnp.zeros(e.num_experts, dtype)) if e.router_bias else None
        self.expert_bias = Buffer(jnp.zeros(e.num_experts, jnp.float32)) if e.expert_bias else None

    def __call__(self, xt: jax.Array, seq_len: int):
        """xt [T, H] -> (topk_idx, topk_weight, counts, the weighted aux + z losses fp32 [])."""
        e, T = self.e, xt.shape[0]
        dt = jnp.promote_types(xt.dtype, jnp.float32)
        logits = xt.astype(dt) @ self.weight[...].astype(dt).T
        if self.bias is not None:
            logits = logits + self.bias[...].astype(dt)
        if e.force_balance != "none":
            raise ValueError(f"moe.force_balance={e.force_balance} is not built in the JAX backend; use none")
        bias = None if self.expert_bias is None else self.expert_bias[...]
        idx, weight, counts, scores = routing.route(
            logits, e.topk, score=e.score_function, num_groups=e.num_groups, topk_groups=e.topk_groups,
            group_score=e.group_score, expert_bias=bias, scaling_factor=e.scaling_factor, normalize=e.normalize_topk)
        losses = jnp.zeros((), jnp.float32)
        if e.aux_loss_coeff > 0:
            probs = routing.aux_probs(scores, e.score_function)
            per_seq = seq_len if e.aux_loss_type == "sequence" else None
            losses = losses + e.aux_loss_coeff * routing.balancing_loss(probs, idx, e.num_experts, per_seq)
        if e.z_loss_coeff > 0:
            losses = losses + e.z_loss_coeff * routing.z_loss(logits)
        if e.capacity_factor is not None:
            cap = routing.capacity(e.capacity_factor, T, e.topk, e.num_experts)
            idx, weight = routing.drop_over_capacity(idx, weight, cap, e.num_experts)
        return idx, weight, counts, losses


class Experts(nnx.Module):
    """w1 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], b1 [E, 2I], b2 [E, H] (moe.expert_linear_bias)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        e, H, std = cfg.moe, cfg.model.hidden_size, cfg.model.init_std
        E, I = e.num_experts, e.moe_ffn_hidden_size
        self.activation = e.activation
        self.w1 = _normal(rngs, (E, 2 * I, H), std, dtype)
        self.w2 = _normal(rngs, (E, H, I), std, dtype)
        self.b1 = nnx.Param(jnp.zeros((E, 2 * I), dtype)) if e.expert_linear_bias else None
        self.b2 = nnx.Param(jnp.zeros((E, H), dtype)) if e.expert_linear_bias else None
        self.parallel_fn = None  # expert parallelism (moetrain.jax.expert_parallel) sets it: moe_experts' signature

    def __call__(self, xt, topk_idx, topk_weight, recompute: bool = False):
        b1 = None if self.b1 is None else self.b1[...]
        b2 = None if self.b2 is None else self.b2[...]
        fn = self.parallel_fn or partial(moe_experts, activation=self.activation)
        if recompute:
            fn = jax.checkpoint(fn)
        return fn(xt, topk_idx, topk_weight, self.w1[...], self.w2[...], b1, b2)


class MoELayer(nnx.Module):
    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        e = cfg.moe
        self.router = Router(cfg, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        shared = cfg.shared_ffn_size
        self.shared = MLP(cfg.model.hidden_size, shared, e.activation, std=cfg.model.init_std, dtype=dtype,
                          rngs=rngs) if shared > 0 else None
        self.tokens_per_expert = Buffer(jnp.zeros(e.num_experts, jnp.float32))
        self.counting = True  # accumulate tokens_per_expert (training forwards)
        self.recompute_experts = False

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, S, H] -> (y [B, S, H], the weighted balancing losses fp32 [])."""
        B, S, H = x.shape
        xt = x.reshape(B * S, H)
        idx, weight, counts, losses = self.router(xt, S)
        if self.counting:
            self.tokens_per_expert[...] = self.tokens_per_expert[...] + jax.lax.stop_gradient(counts)
        y = self.experts(xt, idx, weight, self.recompute_experts).reshape(B, S, H)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, losses


class DecoderLayer(nnx.Module):
    """h += attn(input_norm(h)); h += mlp(post_attn_norm(h)). Returns (h, the MoE losses or 0)."""

    def __init__(self, cfg, moe: bool, window: int | None, *, dtype, rngs: nnx.Rngs):
        m = cfg.model
        self.is_moe = moe
        self.input_norm = RMSNorm(m.hidden_size, m.norm_eps, dtype)
        attn = MLAttention if m.attention_type == "mla" else GQAAttention
        self.attn = attn(cfg, window, dtype=dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(m.hidden_size, m.norm_eps, dtype)
        self.mlp = (MoELayer(cfg, dtype=dtype, rngs=rngs) if moe else
                    MLP(m.hidden_size, m.ffn_hidden_size, m.activation, std=m.init_std, dtype=dtype, rngs=rngs))
        self.recompute = "none"

    def set_recompute(self, mode: str) -> None:
        self.recompute = mode
        self.attn.recompute_core = mode == "selective"
        if self.is_moe:
            self.mlp.recompute_experts = mode == "selective"

    def __call__(self, h: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = h + self.attn(self.input_norm(h), cos, sin)
        if self.is_moe:
            y, losses = self.mlp(self.post_attn_norm(h))
        else:
            y, losses = self.mlp(self.post_attn_norm(h)), jnp.zeros((), jnp.float32)
        return h + y, losses

    def run(self, h: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """__call__, recomputed in backward when this block's recompute is "full"."""
        if self.recompute == "full":
            return nnx.remat(lambda blk, a, c, s: blk(a, c, s))(self, h, cos, sin)
        return self(h, cos, sin)


class MTPDepth(nnx.Module):
    """enorm, hnorm, eh_proj [H, 2H], block, final_norm (models.transformer.MTPDepth)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        m = cfg.model
        H = m.hidden_size
        self.enorm = RMSNorm(H, m.norm_eps, dtype)
        self.hnorm = RMSNorm(H, m.norm_eps, dtype)
        self.eh_proj = Linear(2 * H, H, std=m.init_std, dtype=dtype, rngs=rngs)
        self.block = DecoderLayer(cfg, cfg.is_moe, None, dtype=dtype, rngs=rngs)
        self.final_norm = RMSNorm(H, m.norm_eps, dtype)

    def __call__(self, h_prev, token_embeds, cos, sin):
        x = self.eh_proj(jnp.concatenate([self.enorm(token_embeds), self.hnorm(h_prev)], axis=-1))
        h, losses = self.block.run(x, cos, sin)
        return h, self.final_norm(h), losses


def mtp_tokens_and_targets(labels: jax.Array, depth: int) -> tuple[jax.Array, jax.Array]:
    """Depth d (1-based): tokens with t_{i+d} at position i (0 where unknown or ignored), targets t_{i+d+1}."""
    S = labels.shape[1]
    tokens = jnp.zeros_like(labels).at[:, : S - depth + 1].set(labels[:, depth - 1:])
    tokens = jnp.maximum(tokens, 0)
    targets = jnp.full_like(labels, ops.IGNORE_INDEX).at[:, : S - depth].set(labels[:, depth:])
    return tokens, targets


@dataclass
class Losses:
    loss: jax.Array  # what is differentiated: lm + aux + mtp_loss_scale * mtp
    lm_loss: jax.Array
    aux_loss: jax.Array
    mtp_loss: jax.Array | None


jax.tree_util.register_dataclass(Losses, data_fields=["loss", "lm_loss", "aux_loss", "mtp_loss"], meta_fields=[])


class MoETransformer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        m = cfg.model
        self.cfg = cfg
        H, V = m.hidden_size, m.vocab_size
        rope_dim = m.qk_rope_head_dim if m.attention_type == "mla" else cfg.attn_head_dim
        self.rope = RopeParams.from_model_config(m, rope_dim)
        self.embed = Embedding(V, H, std=m.init_std, dtype=dtype, rngs=rngs)
        self.layers = nnx.Dict({str(i): DecoderLayer(cfg, cfg.is_moe_layer(i), self._window(i), dtype=dtype, rngs=rngs)
                                for i in range(m.num_layers)})
        self.final_norm = RMSNorm(H, m.norm_eps, dtype)
        self.head = None if m.tie_embeddings else Linear(H, V, std=m.init_std, dtype=dtype, rngs=rngs)
        self.mtp = nnx.Dict({str(d): MTPDepth(cfg, dtype=dtype, rngs=rngs) for d in range(m.mtp_num_layers)})
        self.set_recompute(cfg.train.recompute, cfg.train.recompute_layer_ids)

    def _window(self, layer_id: int) -> int | None:
        m = self.cfg.model
        if m.sliding_window is not None and layer_id % m.sliding_window_every == 0:
            return m.sliding_window
        return None

    def blocks(self) -> list[tuple[int, DecoderLayer]]:
        m = self.cfg.model
        return [(i, self.layers[str(i)]) for i in range(m.num_layers)] + [
            (m.num_layers + d, self.mtp[str(d)].block) for d in range(m.mtp_num_layers)]

    def moe_layers(self) -> list[MoELayer]:
        return [blk.mlp for _, blk in self.blocks() if blk.is_moe]

    def set_recompute(self, mode: str, layer_ids=None) -> None:
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"recompute mode {mode!r}; valid: none, selective, full")
        ids = set(layer_ids or ())
        for gid, blk in self.blocks():
            blk.set_recompute("full" if gid in ids else mode)

    def set_counting(self, on: bool) -> None:
        for layer in self.moe_layers():
            layer.counting = on

    def _head_weight(self) -> jax.Array:
        return self.embed.weight[...] if self.head is None else self.head.weight[...]

    def __call__(self, input_ids: jax.Array, labels: jax.Array | None = None):
        cos, sin = ops.rope_tables(self.rope, input_ids.shape[1])
        h = self.embed(input_ids)
        aux = jnp.zeros((), jnp.float32)
        for i in range(self.cfg.model.num_layers):  # by id: a dict's key order is not the layer order
            h, losses = self.layers[str(i)].run(h, cos, sin)
            aux = aux + losses
        if labels is None:
            return self.final_norm(h) @ self._head_weight().T
        return self._loss(h, labels, cos, sin, aux)

    def _token_loss(self, normed: jax.Array, labels: jax.Array) -> jax.Array:
        return ops.cross_entropy(normed @ self._head_weight().T, labels)

    def _loss(self, h, labels, cos, sin, aux) -> Losses:
        lm_loss = self._token_loss(self.final_norm(h), labels)
        mtp_loss = None
        if len(self.mtp):
            depth_losses = []
            for d in range(self.cfg.model.mtp_num_layers):
                depth = self.mtp[str(d)]
                tokens, targets = mtp_tokens_and_targets(labels, d + 1)
                h, normed, losses = depth(h, self.embed(tokens), cos, sin)
                aux = aux + losses
                depth_losses.append(self._token_loss(normed, targets))
            mtp_loss = jnp.mean(jnp.stack(depth_losses))
        loss = lm_loss + aux
        if mtp_loss is not None:
            loss = loss + self.cfg.model.mtp_loss_scale * mtp_loss
        return Losses(loss, jax.lax.stop_gradient(lm_loss), jax.lax.stop_gradient(aux),
                      None if mtp_loss is None else jax.lax.stop_gradient(mtp_loss))
