"""The JAX model's elementwise and attention ops, each the same function as its torch counterpart.

Legend: B batch, S sequence, h heads, D rotary dim, nh query heads, nkv key/value heads, d head dim, dv value
head dim, W sliding window, V vocab.

* ``rms_norm(x [..., D], weight [D], eps)``: fp32 math, weight applied before the cast (models.norm).
* ``rope_tables(params, S)`` -> cos, sin [S, D/2] fp32 from a torch-side ``RopeParams`` (plain Python numbers:
  the same YaRN frequencies, computed in numpy fp32); ``apply_rope(x [B, S, h, D], cos, sin)``: the "two halves"
  layout, in x's dtype (models.rope).
* ``attention_core(q [B, nh, S, d], k [B, nkv, S, d], v [B, nkv, S, dv], scale, window, sinks [nh])`` -> [B, nh, S,
  dv] in v's dtype: causal (query i sees keys j <= i, and i - j < W with a window); without sinks through
  ``jax.nn.dot_product_attention`` (cuDNN flash attention on GPUs where it applies), with GPT-OSS's learned sinks
  an explicit fp32 softmax with the sink as an extra logit column without a value row (models.attention).
* ``gated_activation(gate, up, activation)``: swiglu or GPT-OSS's clamped swiglu (models.mlp).
* ``cross_entropy(logits [..., V], labels [...])``: fp32 mean over labels != -100, 0 when all are ignored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moetrain.models.rope import RopeParams, yarn_ramp_range
from moetrain.ops.moe_rows import CLAMPED_ALPHA, CLAMPED_LIMIT

IGNORE_INDEX = -100


def _compute_dtype(dtype) -> jnp.dtype:
    """fp32 at least (fp64 stays fp64), as the torch side's promote_types(x.dtype, float32)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    dt = _compute_dtype(x.dtype)
    xf = x.astype(dt)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(dt) * xf).astype(x.dtype)


def inv_freq(p: RopeParams) -> np.ndarray:
    """[D/2] fp32 inverse frequencies: RopeParams.inv_freq in numpy (the same fp32 operations)."""
    exponents = np.arange(0, p.dim, 2, dtype=np.float32) / np.float32(p.dim)
    pos_freqs = np.float32(p.theta) ** exponents
    extrap = np.float32(1.0) / pos_freqs
    if not p.yarn:
        return extrap
    interp = np.float32(1.0) / (np.float32(p.factor) * pos_freqs)
    low, high = yarn_ramp_range(p.dim, p.theta, p.original_max_position, p.beta_fast, p.beta_slow, p.truncate)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(p.dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    return (interp * ramp + extrap * (1 - ramp)).astype(np.float32)


def rope_tables(p: RopeParams, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin [S, D/2] fp32 for positions 0..S-1, times the YaRN cos/sin scale."""
    pos = jnp.arange(seq_len, dtype=jnp.float32)
    freqs = jnp.outer(pos, jnp.asarray(inv_freq(p)))
    scale = p.cos_sin_scale
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    c = cos[:, None, :].astype(x.dtype)
    s = sin[:, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def causal_mask(seq_len: int, window: int | None = None) -> jax.Array:
    """[S, S] bool, True where query i may attend key j."""
    i = jnp.arange(seq_len)[:, None]
    j = jnp.arange(seq_len)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    return allowed


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, window: int | None = None,
                   sinks: jax.Array | None = None) -> jax.Array:
    if sinks is None:
        return _fused_attention(q, k, v, scale, window)
    return _explicit_attention(q, k, v, scale, window, sinks)


def _fused_attention(q, k, v, scale: float, window: int | None) -> jax.Array:
    """``jax.nn.dot_product_attention``: causal, GQA, the window as (W - 1 keys back, none ahead). Its value head dim
    must be the query's: MLA's narrower values are zero-padded and the padding sliced off the output.

    On a GPU in bf16/fp16 it runs cuDNN's flash attention, named explicitly: jax's default (implementation=None) is
    XLA's, which keeps the [B, heads, S, S] scores in memory (4.3 GB a layer at 2 x 4096 tokens and 32 heads). A
    shape cuDNN does not take raises there rather than falling back. CPU and fp32/fp64: XLA's."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, d - dv)))
    flash = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    out = jax.nn.dot_product_attention(
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0), implementation="cudnn" if flash else "xla")
    return out.transpose(0, 2, 1, 3)[..., :dv]


def _explicit_attention(q, k, v, scale: float, window: int | None, sinks: jax.Array) -> jax.Array:
    """Softmax over [QK^T * scale, sink] in fp32: the sink column takes probability mass and has no value row."""
    nh, nkv, S = q.shape[1], k.shape[1], q.shape[2]
    if nkv != nh:  # query head h uses kv head h // (nh / nkv)
        k = jnp.repeat(k, nh // nkv, axis=1)
        v = jnp.repeat(v, nh // nkv, axis=1)
    dt = _compute_dtype(q.dtype)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=dt) * scale
    scores = jnp.where(causal_mask(S, window), scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(dt)[None, :, None, None], (q.shape[0], nh, S, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v, preferred_element_type=dt).astype(v.dtype)


def gated_activation(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    if activation == "swiglu":
        return jax.nn.silu(gate) * up
    if activation == "swiglu_clamped":
        gate = jnp.minimum(gate, CLAMPED_LIMIT)
        up = jnp.clip(up, -CLAMPED_LIMIT, CLAMPED_LIMIT)
        return gate * jax.nn.sigmoid(CLAMPED_ALPHA * gate) * (up + 1)
    raise ValueError(f"unknown gated activation {activation!r}; valid: swiglu, swiglu_clamped")


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    V = logits.shape[-1]
    logits = logits.reshape(-1, V).astype(_compute_dtype(logits.dtype))
    labels = labels.reshape(-1)
    valid = labels != IGNORE_INDEX
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.where(valid, labels, 0)[:, None], axis=-1)[:, 0]
    total = jnp.sum(jnp.where(valid, logz - picked, 0.0))
    return total / jnp.maximum(jnp.sum(valid), 1)
