"""Self-attention: GQA/MHA (Llama, Qwen3, Mixtral, GPT-OSS) and MLA (DeepSeek).

Legend: B batch, S sequence, H hidden, nh query heads, nkv key/value heads, hd head dim,
dv value head dim, W sliding window. Both modules map x [B, S, H] -> [B, S, H] given RoPE
tables cos/sin [S, rope_dim/2] (fp32, computed once per forward by the transformer).

The attention core (``attention_core``) works in the parameter dtype:
* plain causal attention -> torch SDPA with is_causal (GQA through enable_gqa);
* sliding window without sinks -> SDPA with an explicit boolean mask;
* learned sinks (GPT-OSS) -> SDPA with the sink as one more key (``sink_attention``): its score is the
  sink logit and its value row is zero, so it takes probability mass and adds nothing; exact, and on
  CUDA the memory-efficient kernel runs it (``sink_attention_reference`` is the explicit fp32 softmax
  it is tested against).
A window W lets query i see keys j with i - W < j <= i (W keys, itself included; HF semantics).

With selective recompute the core is checkpointed: from q, k, v (after RoPE) to the per-head
output before o_proj; projections, norms and RoPE keep their activations.

RoPE (and GQA's q/k RMSNorm before it): on CUDA with triton installed, unless model.fused_rope is off,
moetrain.ops.rope.fused_rope (one Triton kernel per tensor and direction, keeping only its input and an fp32
rstd per row); elsewhere, and for GQA's q/k norms under tensor parallelism (DTensor weights), the eager
RMSNorm and apply_rope. Both compute the same function (kernels.rope's doc says where they round differently).

Tensor parallelism: forward reads the head counts off the projections' outputs (never ``self.nh``),
so after ``ColwiseParallel`` on the q/k/v projections (GQA; q_proj or q_b_proj and kv_b_proj for
MLA) with local outputs and ``RowwiseParallel`` on o_proj, each rank computes its nh/tp query heads
(and nkv/tp kv heads) and o_proj sums the ranks' parts. A rank's query heads then use its own kv
heads, as the global GQA grouping does, when tp divides nkv. The sinks [nh] must be sharded on dim
0 the same way; q/k norms ([hd], per head dim) stay replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.accounting import sink_attention_blocks
from moetrain.models.linear import Linear
from moetrain.models.norm import RMSNorm
from moetrain.models.recompute import checkpoint
from moetrain.models.rope import RopeParams, apply_rope
from moetrain.ops import rope as rope_ops


def causal_mask(seq_len: int, window: int | None = None, device=None) -> torch.Tensor:
    """[S, S] bool, True where query i may attend key j (j <= i, and i - j < W with a window)."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    return allowed


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention. q [B, nh, S, d], k [B, nkv, S, d], v [B, nkv, S, dv] (nkv divides nh);
    sinks [nh] or None. Returns [B, nh, S, dv] in v.dtype. Query head h uses kv head h // (nh/nkv)."""
    nh, nkv, S = q.shape[1], k.shape[1], q.shape[2]
    if sinks is None:
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=nkv != nh)
        mask = causal_mask(S, window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=nkv != nh)
    return sink_attention(q, k, v, scale=scale, window=window, sinks=sinks)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: int | None,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Causal attention whose softmax also runs over a learned logit per head: softmax([QK^T * scale, sink_h])
    with the sink column dropped after it. Shapes as ``attention_core``; sinks [nh].

    The sink is written as a key: q gains a coordinate holding sink_h / scale, a key slot before each band of keys has
    1 there and 0 elsewhere (the real keys 0 there) and a zero value row, so its score is exactly sink_h and it adds
    nothing to the output. q, k and v are padded with zeros to one head dim, a multiple of 8, and the key slots to a
    multiple of 16 (masked): what the memory-efficient CUDA kernel and CPU's flash kernel need; neither takes GQA
    with a mask, so k and v are repeated to nh heads. With a short window the queries go in blocks, each against
    only its band of keys (``accounting.sink_attention_blocks``), so the kernel skips the masked rest."""
    B, nh, S, d = q.shape
    dv, nkv = v.shape[-1], k.shape[1]
    if nkv != nh:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    dp, Q, nb, Kb, left = sink_attention_blocks(max(d, dv), S, window)
    L, Sp = Q + left, nb * Q  # real-key slots per band; queries padded to whole blocks

    def bands(t: torch.Tensor) -> torch.Tensor:  # [B, nh, S, e] -> [B * nb, nh, Kb, dp]: sink slot, band, padding
        t = F.pad(t, (0, dp - t.shape[-1], left, Sp - S)).unfold(2, L, Q)  # [B, nh, nb, dp, L]
        return F.pad(t.permute(0, 2, 1, 4, 3), (0, 0, 1, Kb - L - 1)).reshape(B * nb, nh, Kb, dp)

    sink_q = (sinks / scale).to(q.dtype).view(1, nh, 1, 1).expand(B, nh, S, 1)
    q = torch.cat([q, sink_q, q.new_zeros(B, nh, S, dp - d - 1)], dim=-1)
    q = F.pad(q, (0, 0, 0, Sp - S)).view(B, nh, nb, Q, dp).transpose(1, 2).reshape(B * nb, nh, Q, dp)
    k, v = bands(k), bands(v)
    k[:, :, 0, d] = 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=_band_mask(S, window, Q, nb, Kb, left, q.device)
                                         .repeat(B, 1, 1, 1), scale=scale)
    return out.view(B, nb, nh, Q, dp).transpose(1, 2).reshape(B, nh, Sp, dp)[:, :, :S, :dv]


def _band_mask(S: int, window: int | None, Q: int, nb: int, Kb: int, left: int, device) -> torch.Tensor:
    """[nb, 1, Q, Kb] bool for ``sink_attention``'s blocks: slot 0 (the sink) always; slot j >= 1 holds key
    position i * Q - left + j - 1 for block i, seen by query i * Q + r when causal_mask allows it."""
    block = torch.arange(nb, device=device).view(nb, 1, 1) * Q
    query = block + torch.arange(Q, device=device).view(1, Q, 1)
    slot = torch.arange(Kb, device=device).view(1, 1, Kb)
    key = block - left + slot - 1
    allowed = (slot >= 1) & (slot <= Q + left) & (key >= 0) & (key <= query)
    if window is not None:
        allowed &= query - key < window
    allowed[..., 0] = True
    return allowed.unsqueeze(1)


def sink_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                             window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """``sink_attention`` written out: the [B, nh, S, S + 1] logits softmaxed in fp32 (fp64 stays fp64)."""
    nh, nkv, S = q.shape[1], k.shape[1], q.shape[2]
    if nkv != nh:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale
    dt = torch.promote_types(scores.dtype, torch.float32)
    scores = scores.to(dt).masked_fill(~causal_mask(S, window, q.device), float("-inf"))
    sink = sinks.to(dt).view(1, nh, 1, 1).expand(q.shape[0], nh, S, 1)
    # The diagonal is never masked, so no row is all -inf; softmax subtracts the row max itself.
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


class _CoreMixin:
    """Shared by both attention kinds: the (optionally checkpointed) core call."""

    recompute_core: bool = False
    window: int | None = None

    def _core(self, q, k, v, sinks=None):
        if self.recompute_core:
            if sinks is None:
                return checkpoint(lambda a, b, c: attention_core(a, b, c, scale=self.scale, window=self.window), q, k, v)
            return checkpoint(
                lambda a, b, c, s: attention_core(a, b, c, scale=self.scale, window=self.window, sinks=s),
                q, k, v, sinks)
        return attention_core(q, k, v, scale=self.scale, window=self.window, sinks=sinks)


class GQAAttention(_CoreMixin, nn.Module):
    """Multi-head / grouped-query attention with optional biases, per-head qk RMSNorm (before
    RoPE), sliding window and learned sinks. Parameters: q_proj/k_proj/v_proj/o_proj (+bias),
    q_norm/k_norm [hd], sinks [nh]."""

    def __init__(self, cfg, window: int | None = None):
        super().__init__()
        m = cfg.model
        H, nh, nkv, hd = m.hidden_size, m.num_attention_heads, cfg.kv_heads, cfg.attn_head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        out_bias = m.attention_bias if m.attention_out_bias is None else m.attention_out_bias
        self.q_proj = Linear(H, nh * hd, bias=m.attention_bias)
        self.k_proj = Linear(H, nkv * hd, bias=m.attention_bias)
        self.v_proj = Linear(H, nkv * hd, bias=m.attention_bias)
        self.o_proj = Linear(nh * hd, H, bias=out_bias)
        self.q_norm = RMSNorm(hd, m.norm_eps) if m.qk_norm else None
        self.k_norm = RMSNorm(hd, m.norm_eps) if m.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(nh)) if m.attention_sinks else None
        self.window = window
        self.rope = RopeParams.from_model_config(m, hd)
        self.scale = hd ** -0.5 * self.rope.softmax_scale_multiplier
        self.fused_rope = m.fused_rope

    def _fused(self, q: torch.Tensor, cos: torch.Tensor) -> bool:
        """Whether q and k take the fused op: model.fused_rope, a tensor the kernels run on, and plain norm weights
        (under tensor parallelism they are DTensors whose gradient comes back Partial: the eager norms run)."""
        if not self.fused_rope or not rope_ops.fused_rope_runs_here(q, cos):
            return False
        if self.q_norm is None:
            return True
        from torch.distributed.tensor import DTensor

        return not isinstance(self.q_norm.weight, DTensor)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, -1, self.hd)  # heads from the shapes: a TP rank holds nh/tp of them
        k = self.k_proj(x).view(B, S, -1, self.hd)
        v = self.v_proj(x).view(B, S, -1, self.hd)
        if not self._fused(q, cos):
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif self.q_norm is None:
            q, k = rope_ops.fused_rope(q, cos, sin), rope_ops.fused_rope(k, cos, sin)
        else:
            q = rope_ops.fused_rope(q, cos, sin, self.q_norm.weight, self.q_norm.eps)
            k = rope_ops.fused_rope(k, cos, sin, self.k_norm.weight, self.k_norm.eps)
        o = self._core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.sinks)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


class MLAttention(_CoreMixin, nn.Module):
    """DeepSeek multi-head latent attention.

    q = q_b_proj(q_a_norm(q_a_proj(x))) (or q_proj(x) without q_lora_rank), per head split into
    [nope | rope]. kv_a_proj(x) = [latent c (kvl) | shared rope key (rope)]; kv_b_proj(kv_a_norm(c))
    per head = [k_nope | v]. Key = [k_nope | rope(k_rope) broadcast over heads]; query =
    [q_nope | rope(q_rope)]. Softmax scale (nope+rope)^-1/2 times the YaRN mscale correction.
    """

    def __init__(self, cfg, window: int | None = None):
        super().__init__()
        m = cfg.model
        H, nh = m.hidden_size, m.num_attention_heads
        self.nh, self.nope, self.rope_dim, self.dv = nh, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kvl = m.kv_lora_rank
        qk = self.nope + self.rope_dim
        if m.q_lora_rank:
            self.q_a_proj = Linear(H, m.q_lora_rank)
            self.q_a_norm = RMSNorm(m.q_lora_rank, m.norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, nh * qk)
            self.q_proj = None
        else:
            self.q_proj = Linear(H, nh * qk)
        self.kv_a_proj = Linear(H, self.kvl + self.rope_dim)
        self.kv_a_norm = RMSNorm(self.kvl, m.norm_eps)
        self.kv_b_proj = Linear(self.kvl, nh * (self.nope + self.dv))
        self.o_proj = Linear(nh * self.dv, H)
        self.window = window
        self.rope = RopeParams.from_model_config(m, self.rope_dim)
        self.scale = qk ** -0.5 * self.rope.softmax_scale_multiplier
        self.fused_rope = m.fused_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(B, S, -1, self.nope + self.rope_dim)  # heads from the shapes (nh/tp on a TP rank)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj(x).split([self.kvl, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(c)).view(B, S, -1, self.nope + self.dv)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        rope = rope_ops.fused_rope if self.fused_rope and rope_ops.fused_rope_runs_here(q_rope, cos) else apply_rope
        q_rope = rope(q_rope, cos, sin)
        k_rope = rope(k_rope.unsqueeze(2), cos, sin).expand(B, S, q_rope.shape[2], self.rope_dim)  # rotated once
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        o = self._core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))


def build_attention(cfg, window: int | None = None) -> nn.Module:
    return MLAttention(cfg, window) if cfg.model.attention_type == "mla" else GQAAttention(cfg, window)
