"""MoETransformer: embedding -> decoder layers (dense or MoE) -> final norm -> output head (+ MTP).

Legend: B batch, S sequence, H hidden, V vocab, D MTP depths, L decoder layers.

Contract: ``MoETransformer(cfg)``; ``forward(inputs, labels [B, S] int64 | None)`` with inputs the token ids
input_ids [B, S] int64. Without labels -> logits [B, S, V] in the parameter dtype. With labels (labels[b, i] =
token after input_ids[b, i], -100 = ignore) -> ``ModelOutput``.

Pipeline stages: ``keep_only`` (or ``models.stages.split_stages``) removes what a stage does not hold. The layers
are an ``nn.ModuleDict`` keyed by global layer id and the MTP depths one keyed by depth, so a stage's parameter
names are the whole model's. A stage without the input embedding takes hidden states h [B, S, H] as ``inputs``; a
stage without the final norm returns its last layer's h [B, S, H]; the last stage computes the loss (``loss``).
Every block returns one tensor: the MoE layers' balancing losses reach the backward through autograd
(``moe.aux_loss``), and ``ModelOutput.aux_loss`` sums the detached values of the blocks this module holds.

MTP depth d (1-based): position i gets the token t_{i+d} (= labels[i + d - 1]) and the previous
depth's hidden state (the main model's last-layer output for d = 1, before the final norm):
h = eh_proj(cat[enorm(embed(t_{i+d})), hnorm(h_prev)]) -> one decoder block -> its final_norm ->
the shared output head; the target is t_{i+d+1} (= labels[i + d]); positions past the end are
ignored. MTP blocks use full causal attention (no sliding window), as the accounting assumes.

Tensor parallelism (``distributed.tensor_parallel``) is applied from outside; blocks then take and return plain
tensors (a sequence slice under sequence parallelism) and ``seq_shards`` is its one attribute here.

Recompute (``set_recompute``; the constructor applies train.recompute / recompute_layer_ids):
* full: each decoder layer (or MTP block) runs under activation checkpointing; only its input
  is kept and the whole layer is recomputed in backward.
* selective: the attention core (q, k, v after RoPE -> per-head output before o_proj) and the
  routed-expert computation (the ``ops.moe_experts`` call) are checkpointed; dense MLPs, shared
  experts, projections, norms and the router keep their activations.
* layer_ids: global block ids (decoder layer i = i, MTP depth d (0-based) = num_layers + d) that
  get full recompute; the other blocks use ``mode``.

Weights: ``init_weights`` sets every Linear/Embedding/expert/router weight and the sinks to
normal(0, init_std) (``models.init``: values a function of a base seed drawn once from torch's global RNG, the
parameter's name and its global shape, so sharded and pipeline-split models get the same ones), norms to 1,
biases to 0, expert_bias and the load counters to 0. Construction allocates with torch.empty and then calls it, so a
model built under ``torch.device("meta")`` can be materialised with ``to_empty`` followed by
``init_weights`` and gets the same values for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.models.attention import build_attention
from moetrain.models.linear import Embedding, Linear
from moetrain.models.mlp import MLP
from moetrain.models.moe.layer import MoELayer
from moetrain.models.moe.router import Router, zero_loss
from moetrain.models.norm import RMSNorm
from moetrain.models.recompute import checkpoint
from moetrain.models.rope import RopeParams

RECOMPUTE_MODES = ("none", "selective", "full")
IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    # scalar with grad: lm_loss + mtp_loss_scale * mtp_loss, plus the aux terms' value (their gradient reaches the
    # routers through the MoE layers' outputs)
    loss: torch.Tensor
    lm_loss: torch.Tensor  # detached fp32
    aux_loss: torch.Tensor  # detached fp32: sum over MoE layers of coeff * aux + z_coeff * z
    mtp_loss: Optional[torch.Tensor]  # detached fp32 mean over depths, None without MTP


def _sum_terms(terms: list, device: torch.device) -> torch.Tensor:
    """The sum of the MoE layers' 0-dim loss terms (one dtype: the routers') in one stack and one reduction: two
    kernels however many layers, where an add per layer was one kernel and ~50-80 us of host time each on the H200
    host. A shared fp32 zero without terms."""
    if not terms:
        return zero_loss(device)
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(input_norm(h)); h += mlp(post_attn_norm(h)).
    forward(h [B, S, H], cos, sin) -> h [B, S, H]."""

    def __init__(self, cfg, moe: bool, window: int | None):
        super().__init__()
        m = cfg.model
        self.is_moe = moe
        self.input_norm = RMSNorm(m.hidden_size, m.norm_eps)
        self.attn = build_attention(cfg, window)
        self.post_attn_norm = RMSNorm(m.hidden_size, m.norm_eps)
        self.mlp = MoELayer(cfg) if moe else MLP(m.hidden_size, m.ffn_hidden_size, m.activation)
        self.recompute = "none"

    def set_recompute(self, mode: str) -> None:
        self.recompute = mode
        self.attn.recompute_core = mode == "selective"
        if self.is_moe:
            self.mlp.recompute_experts = mode == "selective"

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), cos, sin)
        return h + self.mlp(self.post_attn_norm(h))

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """forward, under activation checkpointing when this block's recompute is "full"."""
        if self.recompute == "full":
            return checkpoint(self, h, cos, sin)
        return self(h, cos, sin)

    def aux_value(self) -> torch.Tensor | None:
        """The MoE layer's detached weighted losses of the last forward (None for a dense block)."""
        return self.mlp.aux_value if self.is_moe else None


class MTPDepth(nn.Module):
    """One multi-token-prediction depth: enorm, hnorm, eh_proj [H, 2H], block, final_norm.
    forward(h_prev [B, S, H], token_embeds [B, S, H], cos, sin) -> (h [B, S, H], final_norm(h) [B, S, H])."""

    def __init__(self, cfg):
        super().__init__()
        m = cfg.model
        H = m.hidden_size
        self.enorm = RMSNorm(H, m.norm_eps)
        self.hnorm = RMSNorm(H, m.norm_eps)
        self.eh_proj = Linear(2 * H, H)
        self.block = DecoderLayer(cfg, cfg.is_moe, window=None)
        self.final_norm = RMSNorm(H, m.norm_eps)

    def forward(self, h_prev: torch.Tensor, token_embeds: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(h_prev)], dim=-1))
        h = self.block.run(x, cos, sin)
        return h, self.final_norm(h)


def mtp_tokens_and_targets(labels: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For MTP depth d (1-based): tokens [B, S] with t_{i+d} at position i (0 where unknown or
    ignored) and targets [B, S] with t_{i+d+1} (-100 past the end)."""
    S = labels.shape[1]
    tokens = torch.zeros_like(labels)
    tokens[:, : S - depth + 1] = labels[:, depth - 1:]
    tokens = tokens.clamp(min=0)  # ignored labels (-100) cannot be embedded
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, : S - depth] = labels[:, depth:]
    return tokens, targets


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 cross-entropy, mean over labels != -100 (0 when all are ignored); sync-free."""
    V = logits.shape[-1]
    total = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    count = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


def token_loss(normed: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the logits normed @ weight^T against labels (-100 ignored), fp32 []: normed
    [B, S, H], weight [V, H], labels [B, S]: the logits [B, S, V] in the parameter dtype, then ``cross_entropy``."""
    return cross_entropy(F.linear(normed, weight), labels)


def fused_token_loss(normed: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``token_loss`` through ``ops.linear_cross_entropy`` (train.fused_loss): chunked over tokens, the gradient made in
    the same pass, no [T, V] logits kept; the same numbers up to fp32 summation order."""
    from moetrain.ops import linear_cross_entropy_mean

    H = normed.shape[-1]
    return linear_cross_entropy_mean(normed.reshape(-1, H), weight, labels.reshape(-1))


class MoETransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        m = cfg.model
        H, V = m.hidden_size, m.vocab_size
        rope_dim = m.qk_rope_head_dim if m.attention_type == "mla" else cfg.attn_head_dim
        self.rope = RopeParams.from_model_config(m, rope_dim)
        self.embed = Embedding(V, H)
        self.embeds_input = True  # inputs are token ids (False: a later pipeline stage's hidden states)
        self.is_stage = False  # keep_only made this one pipeline stage: it holds part of the model's weights
        # ranks the sequence of hidden-state inputs is split over (sequence parallelism sets it: such a stage gets its
        # rank's [B, S / seq_shards, H] and its RoPE tables must still cover the whole sequence)
        self.seq_shards = 1
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, cfg.is_moe_layer(i), self._window(i)) for i in range(m.num_layers)})
        self.final_norm = RMSNorm(H, m.norm_eps)
        self.head = None if m.tie_embeddings else Linear(H, V)
        # (normed, weight, labels) -> mean cross-entropy; tensor parallelism replaces the fused one by its own
        self.token_loss = fused_token_loss if cfg.train.fused_loss else token_loss
        self.mtp = nn.ModuleDict({str(d): MTPDepth(cfg) for d in range(m.mtp_num_layers)})
        self.init_weights()
        self.set_recompute(cfg.train.recompute, cfg.train.recompute_layer_ids)

    def _window(self, layer_id: int) -> int | None:
        m = self.cfg.model
        if m.sliding_window is not None and layer_id % m.sliding_window_every == 0:
            return m.sliding_window
        return None

    # ---- weights ------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Weights from ``seed`` (default: one draw from torch's global RNG) by ``models.init``: the same values
        for a parameter of the same name and global shape whether this module is whole, a pipeline stage, or
        sharded (FSDP2, expert parallelism)."""
        from moetrain.models import init

        if any(p.is_meta for p in self.parameters()):
            return  # a meta build: nothing to fill, and no draw (to_empty + init_weights draws the same as a build)
        seed = init.base_seed() if seed is None else seed
        std = self.cfg.model.init_std
        for prefix, module in self.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if isinstance(module, RMSNorm):
                    p.fill_(1.0)
                elif name in ("bias", "b1", "b2"):
                    p.zero_()
                else:
                    init.normal_(p, std, seed, f"{prefix}.{name}" if prefix else name)
            if isinstance(module, Router) and module.expert_bias is not None:
                module.expert_bias.zero_()
            if isinstance(module, MoELayer):
                module.tokens_per_expert.zero_()

    # ---- structure ----------------------------------------------------------------------

    def blocks(self) -> list[tuple[int, DecoderLayer]]:
        """(global id, decoder block) of the blocks held: layers 0..L-1, then MTP depth d at L + d."""
        L = self.cfg.model.num_layers
        out = [(int(i), blk) for i, blk in self.layers.items()]
        out += [(L + int(d), depth.block) for d, depth in self.mtp.items()]
        return out

    def keep_only(self, layer_ids, mtp_depths, *, embedding: bool, loss: bool) -> "MoETransformer":
        """Make this module one pipeline stage (in place; returns self): keep the decoder layers ``layer_ids`` and
        the MTP depths ``mtp_depths`` (0-based), the input embedding when ``embedding``, the final norm and head
        (and the loss) when ``loss``. The embedding's weight also stays where the loss needs it (a tied head, MTP)."""
        self.is_stage = True
        keep_layers, keep_mtp = {str(i) for i in layer_ids}, {str(d) for d in mtp_depths}
        for name in [k for k in self.layers if k not in keep_layers]:
            del self.layers[name]
        for name in [k for k in self.mtp if k not in keep_mtp]:
            del self.mtp[name]
        if keep_mtp and not loss:
            raise ValueError("keep_only: MTP depths need the loss on the same stage (their loss uses the head)")
        self.embeds_input = embedding
        needs_embed = embedding or (loss and (self.head is None or bool(keep_mtp)))
        if not needs_embed:
            self.embed = None
        if not loss:
            self.final_norm = self.head = None
        return self

    def moe_layers(self) -> list[MoELayer]:
        return [blk.mlp for _, blk in self.blocks() if blk.is_moe]

    @torch.no_grad()
    def update_expert_bias(self, rate: float | None = None, keep: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step on every MoE layer (rate defaults to moe.expert_bias_update_rate;
        ``keep``: see MoELayer.update_expert_bias)."""
        if rate is None:
            rate = self.cfg.moe.expert_bias_update_rate
        for layer in self.moe_layers():
            layer.update_expert_bias(rate, keep)

    @torch.no_grad()
    def reset_moe_stats(self) -> None:
        for layer in self.moe_layers():
            layer.reset_stats()

    @torch.no_grad()
    def load_imbalance(self) -> torch.Tensor | None:
        """[number of MoE layers] fp32 max/mean of accumulated counts per layer (None if dense)."""
        layers = self.moe_layers()
        return torch.stack([layer.load_imbalance() for layer in layers]) if layers else None

    def set_recompute(self, mode: str, layer_ids=None) -> None:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode {mode!r}; valid: {', '.join(RECOMPUTE_MODES)}")
        m = self.cfg.model
        total = m.num_layers + m.mtp_num_layers
        ids = set(layer_ids or ())
        bad = sorted(i for i in ids if not 0 <= i < total)
        if bad:
            raise ValueError(f"recompute layer ids {bad}: valid ids are 0..{total - 1}")
        for gid, blk in self.blocks():
            blk.set_recompute("full" if gid in ids else mode)

    def set_aux_grad_scale(self, scale: float) -> None:
        """The factor the training loss is multiplied by before backward (1 / micro-batches per step): the MoE
        layers' balancing losses get that gradient through autograd (see ``moe.aux_loss``)."""
        for layer in self.moe_layers():
            layer.aux_grad_scale = scale

    # ---- forward ------------------------------------------------------------------------

    def _head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self._head_weight())

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None):
        """inputs: input_ids [B, S] int64, or h [B, S, H] on a stage without the input embedding ([B, S / seq_shards,
        H] under sequence parallelism). Returns h (as the input's) on a stage without the loss, else logits [B, S, V]
        without labels and ModelOutput with them."""
        S = inputs.shape[1] if self.embeds_input else inputs.shape[1] * self.seq_shards
        cos, sin = self.rope.tables(S, device=inputs.device)
        h = self.embed(inputs) if self.embeds_input else inputs
        for blk in self.layers.values():
            h = blk.run(h, cos, sin)
        if self.final_norm is None:
            return h
        if labels is None:
            return self._logits(self.final_norm(h))
        return self.loss(h, labels, cos, sin)

    def loss(self, h: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> ModelOutput:
        """The last stage's loss from its last decoder layer's output h [B, S, H] (before the final norm): the LM
        cross-entropy, the MTP depths' (which run here), and the aux terms' logged value."""
        lm_loss = self.token_loss(self.final_norm(h), self._head_weight(), labels)
        mtp_loss = None
        if len(self.mtp):
            losses = []
            for d, depth in self.mtp.items():
                tokens, targets = mtp_tokens_and_targets(labels, int(d) + 1)
                h, normed = depth(h, self.embed(tokens), cos, sin)
                losses.append(self.token_loss(normed, self._head_weight(), targets))
            mtp_loss = torch.stack(losses).mean()
        aux = self.aux_value()
        loss = lm_loss + aux
        if mtp_loss is not None:
            loss = loss + self.cfg.model.mtp_loss_scale * mtp_loss
        return ModelOutput(
            loss=loss,
            lm_loss=lm_loss.detach().float(),
            aux_loss=aux.float(),
            mtp_loss=None if mtp_loss is None else mtp_loss.detach().float(),
        )

    def aux_value(self) -> torch.Tensor:
        """fp32 [] detached sum of the weighted balancing losses of the MoE blocks held, from their last forward."""
        terms = [v for _, blk in self.blocks() if (v := blk.aux_value()) is not None]
        device = next(self.parameters()).device
        return _sum_terms(terms, device)
