"""Parameters, active parameters and training FLOPs per token, from the config alone.

Pure Python (no torch): `moetrain model info` and the planner use it without building a model.

Parameter counts follow the parameter inventory of ``MoETransformer`` exactly (the contract in
the project notes), so ``count_params(cfg).total_params_with_mtp`` equals
``sum(p.numel() for p in MoETransformer(cfg).parameters())``. Buffers (``router.expert_bias``,
RoPE tables) are not parameters and are not counted.

Components of the breakdown, by parameter-name prefix of the model:

    embedding       embed.*
    attention       layers.{i}.attn.*   (projections, their biases, q/k/kv-latent norms, sinks)
    dense_mlp       layers.{i}.mlp.{gate,up,down}_proj of dense layers (no gate_proj for gelu)
    routed_experts  layers.{i}.mlp.experts.*
    shared_experts  layers.{i}.mlp.shared.*
    router          layers.{i}.mlp.router.*
    norms           layers.{i}.input_norm, layers.{i}.post_attn_norm, final_norm
    mtp             mtp.*   (everything of the MTP depths; embedding and head are shared, not here)
    output_head     head.*  (0 when model.tie_embeddings)

Active parameters per token: every parameter except the routed experts, plus topk/E of them
(embedding and output head included). Published figures differ in convention: DeepSeek and
OpenAI (gpt-oss) leave the input embedding out of "activated parameters" (a lookup is not
compute), Mistral and Qwen count it. ``active_params_no_embedding`` gives the former.

The headline ``total_params``/``active_params`` exclude MTP, as the published figures do
(DeepSeek-V3: 671B without its MTP module, ~682.6B with it; Hugging Face's 685B also counts the
MTP module's stored copies of the embedding and head). The ``*_with_mtp`` fields include it.

Training FLOPs per token (see ``flops_per_token``), with S = sequence length:

    forward = 2 * N_matmul + sum over attention layers of 2 * heads * (d_qk + d_v) * ctx
    train   = 3 * forward          (backward = 2 x forward: input grads + weight grads)

    N_matmul  active weights that multiply activations, per token: attention projections,
              dense MLP, top-k routed experts, shared experts, router, output head, and for
              each MTP depth its eh_proj, its block and the (shared) output head again.
              Excluded: the embedding lookup, norms, biases, sinks (no matmul).
    d_qk, d_v per-head query/key and value dims (GQA: head_dim both; MLA: nope+rope and v_head_dim)
    ctx       keys attended per query, averaged over the S positions. Causal attention:
              (S+1)/2. A sliding-window layer (window W) caps it: (1/S) * sum_i min(i+1, W).
              The factor 2*(d_qk+d_v) is 2 FLOPs per multiply-add times the QK^T and PV matmuls.

A dense masked kernel computes all S keys per query; ``attention_context="full"`` gives that
count (ctx = S, no window), which is what torch's FlopCounterMode reports for SDPA.
MTP blocks are counted with full causal attention (no sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Optional

from moetrain.config.schema import Config
from moetrain.kernels.host import cdiv

COMPONENTS = (
    "embedding", "attention", "dense_mlp", "routed_experts", "shared_experts",
    "router", "norms", "mtp", "output_head",
)
LAYER_COMPONENTS = ("attention", "dense_mlp", "routed_experts", "shared_experts", "router", "norms")


@dataclass(frozen=True)
class Count:
    """Parameters of one component: all of them, and those a single token uses."""

    total: int = 0
    active: int = 0

    def __add__(self, other: "Count") -> "Count":
        return Count(self.total + other.total, self.active + other.active)

    def __mul__(self, k: int) -> "Count":
        return Count(self.total * k, self.active * k)


@dataclass
class ParamCounts:
    """Result of ``count_params``. ``breakdown`` sums to the ``*_with_mtp`` figures."""

    breakdown: dict[str, Count]
    mtp_breakdown: dict[str, Count]  # what ``breakdown["mtp"]`` is made of (layer components + mtp_extra)
    total_params: int  # headline: without MTP
    active_params: int  # headline: without MTP, embedding included
    total_params_with_mtp: int
    active_params_with_mtp: int
    active_params_no_embedding: int  # without MTP and without the input embedding
    mtp_included: bool = False  # whether total_params/active_params include MTP (never: see module doc)

    @property
    def total(self) -> int:
        """Alias of the headline ``total_params`` (without MTP)."""
        return self.total_params

    @property
    def active(self) -> int:
        """Alias of the headline ``active_params`` (without MTP)."""
        return self.active_params

    def to_dict(self) -> dict:
        return {
            "total_params": self.total_params,
            "active_params": self.active_params,
            "mtp_included": self.mtp_included,
            "total_params_with_mtp": self.total_params_with_mtp,
            "active_params_with_mtp": self.active_params_with_mtp,
            "active_params_no_embedding": self.active_params_no_embedding,
            "breakdown": {k: {"total": v.total, "active": v.active} for k, v in self.breakdown.items()},
        }


@dataclass
class FlopCounts:
    """Result of ``flops_per_token``: FLOPs per token of one training sequence."""

    seq_length: int
    matmul_params: int  # N_matmul: active weights multiplied per token (incl. head, MTP)
    matmul_forward: int  # 2 * matmul_params
    attention_forward: float  # score + value FLOPs, summed over layers (and MTP blocks)
    forward: float
    train: float
    by_layer_attention: list[float] = field(default_factory=list)  # decoder layers, then MTP depths


# ---- per-module parameter counts (exactly the inventory) --------------------------------------


def attention_params(cfg: Config) -> int:
    """Parameters of one attention module (``layers.{i}.attn.*``)."""
    m = cfg.model
    H, nh = m.hidden_size, m.num_attention_heads
    if m.attention_type == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        n = 0
        if m.q_lora_rank:
            n += m.q_lora_rank * H + m.q_lora_rank + nh * qk * m.q_lora_rank
        else:
            n += nh * qk * H
        n += (m.kv_lora_rank + m.qk_rope_head_dim) * H + m.kv_lora_rank
        n += nh * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
        n += H * nh * m.v_head_dim
        return n
    hd, kv = cfg.attn_head_dim, cfg.kv_heads
    q, kvd = nh * hd, kv * hd
    n = q * H + 2 * kvd * H + H * q
    if m.attention_bias:
        n += q + 2 * kvd
    out_bias = m.attention_bias if m.attention_out_bias is None else m.attention_out_bias
    if out_bias:
        n += H
    if m.qk_norm:
        n += 2 * hd
    if m.attention_sinks:
        n += nh
    return n


class SinkBlocks(NamedTuple):
    """How models.attention.sink_attention lays out one sequence: ``blocks`` blocks of ``queries`` queries, each
    against ``keys`` key slots (the sink, its band of real keys, masked padding), at head dim ``head_dim``; a band
    starts ``left`` positions before its block's first query."""

    head_dim: int
    queries: int
    blocks: int
    keys: int
    left: int

    @property
    def query_rows(self) -> int:
        """Query rows of one sequence, padded to whole blocks."""
        return self.blocks * self.queries

    @property
    def key_slots(self) -> int:
        """Key slots of one sequence over all its blocks."""
        return self.blocks * self.keys


def sink_attention_blocks(head_dim: int, seq_len: int, window: int | None) -> SinkBlocks:
    """The layout of GQA attention with learned sinks: the head dim one coordinate more (the sink's), to a multiple
    of 8; keys to a multiple of 16. Without a window one block of all S queries against all keys; with a window W,
    blocks of round_up(W, 128) queries against their band of the W - 1 keys before the block and the block's own,
    where that takes under half the key slots of one block."""
    dp = cdiv(head_dim + 1, 8) * 8
    full = SinkBlocks(dp, seq_len, 1, cdiv(seq_len + 1, 16) * 16, 0)
    if window is None:
        return full
    q = cdiv(window, 128) * 128
    band = SinkBlocks(dp, q, cdiv(seq_len, q), cdiv(q + window, 16) * 16, window - 1)
    return band if 2 * band.keys < full.keys else full


def attention_matmul_params(cfg: Config) -> int:
    """Weights of one attention module that multiply activations (no norms, biases, sinks)."""
    m = cfg.model
    H, nh = m.hidden_size, m.num_attention_heads
    if m.attention_type == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        n = (m.q_lora_rank * H + nh * qk * m.q_lora_rank) if m.q_lora_rank else nh * qk * H
        n += (m.kv_lora_rank + m.qk_rope_head_dim) * H
        n += nh * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
        return n + H * nh * m.v_head_dim
    hd, kv = cfg.attn_head_dim, cfg.kv_heads
    return 2 * nh * hd * H + 2 * kv * hd * H


def attention_head_dims(cfg: Config) -> tuple[int, int]:
    """(query/key dim, value dim) per head, as used by the score and value matmuls."""
    m = cfg.model
    if m.attention_type == "mla":
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return cfg.attn_head_dim, cfg.attn_head_dim


def dense_mlp_params(cfg: Config) -> int:
    m = cfg.model
    rows = 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size
    return rows * m.hidden_size + m.hidden_size * m.ffn_hidden_size


def expert_params(cfg: Config) -> int:
    """Parameters of one routed expert (its slice of ``experts.w1/w2`` and biases)."""
    H, I = cfg.model.hidden_size, cfg.moe.moe_ffn_hidden_size
    n = 2 * I * H + H * I
    if cfg.moe.expert_linear_bias:
        n += 2 * I + H
    return n


def expert_matmul_params(cfg: Config) -> int:
    H, I = cfg.model.hidden_size, cfg.moe.moe_ffn_hidden_size
    return 3 * I * H


def router_params(cfg: Config) -> int:
    e = cfg.moe
    return e.num_experts * cfg.model.hidden_size + (e.num_experts if e.router_bias else 0)


def shared_params(cfg: Config) -> int:
    return 3 * cfg.shared_ffn_size * cfg.model.hidden_size


def layer_counts(cfg: Config, moe: bool) -> dict[str, Count]:
    """Per-component counts of one decoder layer (dense MLP or MoE)."""
    H = cfg.model.hidden_size
    attn = attention_params(cfg)
    out = {k: Count() for k in LAYER_COMPONENTS}
    out["attention"] = Count(attn, attn)
    out["norms"] = Count(2 * H, 2 * H)
    if moe:
        e = cfg.moe
        per_expert = expert_params(cfg)
        out["routed_experts"] = Count(e.num_experts * per_expert, e.topk * per_expert)
        sh, rt = shared_params(cfg), router_params(cfg)
        out["shared_experts"] = Count(sh, sh)
        out["router"] = Count(rt, rt)
    else:
        d = dense_mlp_params(cfg)
        out["dense_mlp"] = Count(d, d)
    return out


def mtp_depth_counts(cfg: Config) -> dict[str, Count]:
    """Counts of one MTP depth: its block's components plus ``mtp_extra`` (enorm, hnorm,
    eh_proj, final_norm). Embedding and head are shared with the main model."""
    H = cfg.model.hidden_size
    out = layer_counts(cfg, moe=cfg.is_moe)
    extra = 3 * H + 2 * H * H
    out["mtp_extra"] = Count(extra, extra)
    return out


# ---- whole-model counts ----------------------------------------------------------------------


def count_params(cfg: Config) -> ParamCounts:
    """Total and active parameters, per component, with and without MTP."""
    m = cfg.model
    H, V = m.hidden_size, m.vocab_size
    parts = {k: Count() for k in COMPONENTS}
    parts["embedding"] = Count(V * H, V * H)
    if not m.tie_embeddings:
        parts["output_head"] = Count(V * H, V * H)
    parts["norms"] = Count(H, H)  # final_norm
    for i in range(m.num_layers):
        for k, c in layer_counts(cfg, cfg.is_moe_layer(i)).items():
            parts[k] = parts[k] + c

    mtp_parts: dict[str, Count] = {}
    if m.mtp_num_layers:
        depth = mtp_depth_counts(cfg)
        mtp_parts = {k: c * m.mtp_num_layers for k, c in depth.items()}
        parts["mtp"] = Count(sum(c.total for c in mtp_parts.values()), sum(c.active for c in mtp_parts.values()))

    total_mtp = sum(c.total for c in parts.values())
    active_mtp = sum(c.active for c in parts.values())
    total = total_mtp - parts["mtp"].total
    active = active_mtp - parts["mtp"].active
    return ParamCounts(
        breakdown=parts,
        mtp_breakdown=mtp_parts,
        total_params=total,
        active_params=active,
        total_params_with_mtp=total_mtp,
        active_params_with_mtp=active_mtp,
        active_params_no_embedding=active - parts["embedding"].active,
    )


# ---- FLOPs -----------------------------------------------------------------------------------


def average_context(seq_length: int, window: Optional[int] = None) -> float:
    """Keys attended per query, averaged over positions 0..S-1 of a causal sequence.

    Query i sees min(i+1, W) keys (itself included); without a window W = S, giving (S+1)/2.
    """
    S = seq_length
    W = S if window is None else min(window, S)
    # sum_{i<W} (i+1) + (S-W) * W
    return (W * (W + 1) / 2 + (S - W) * W) / S


def uses_sliding_window(cfg: Config, layer_id: int) -> bool:
    m = cfg.model
    return m.sliding_window is not None and layer_id % m.sliding_window_every == 0


def matmul_params_per_token(cfg: Config, include_mtp: bool = True) -> int:
    """N_matmul: active weights that multiply activations per token (see module doc)."""
    m, e = cfg.model, cfg.moe
    H, V = m.hidden_size, m.vocab_size

    def block(moe: bool) -> int:
        n = attention_matmul_params(cfg)
        if moe:
            n += e.topk * expert_matmul_params(cfg) + shared_params(cfg) + e.num_experts * H
        else:
            rows = 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size
            n += rows * H + H * m.ffn_hidden_size
        return n

    n = sum(block(cfg.is_moe_layer(i)) for i in range(m.num_layers)) + V * H
    if include_mtp:
        n += m.mtp_num_layers * (2 * H * H + block(cfg.is_moe) + V * H)
    return n


def flops_per_token(
    cfg: Config,
    seq_length: Optional[int] = None,
    *,
    include_mtp: bool = True,
    attention_context: Literal["causal", "full"] = "causal",
) -> FlopCounts:
    """Forward and training FLOPs per token for sequences of ``seq_length`` (default
    ``train.seq_length``). ``attention_context="full"`` counts S keys per query (a dense
    masked kernel) instead of the causal average. Formula in the module docstring."""
    m = cfg.model
    S = seq_length or cfg.train.seq_length
    nh = m.num_attention_heads
    d_qk, d_v = attention_head_dims(cfg)
    per_ctx = 2 * nh * (d_qk + d_v)

    def ctx(window: Optional[int]) -> float:
        return float(S) if attention_context == "full" else average_context(S, window)

    by_layer = [
        per_ctx * ctx(m.sliding_window if uses_sliding_window(cfg, i) else None) for i in range(m.num_layers)
    ]
    if include_mtp:
        by_layer += [per_ctx * ctx(None)] * m.mtp_num_layers
    n_mm = matmul_params_per_token(cfg, include_mtp)
    attn = sum(by_layer)
    fwd = 2 * n_mm + attn
    return FlopCounts(
        seq_length=S, matmul_params=n_mm, matmul_forward=2 * n_mm, attention_forward=attn,
        forward=fwd, train=3 * fwd, by_layer_attention=by_layer,
    )


def train_flops_per_token(cfg: Config, seq_length: Optional[int] = None) -> float:
    """Model FLOPs of one training step per token (forward + backward, MTP included):
    the numerator of MFU. See the module docstring for the formula."""
    return flops_per_token(cfg, seq_length).train
