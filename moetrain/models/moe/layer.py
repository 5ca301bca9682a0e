"""MoE layer in named phases: route -> dispatch -> experts -> combine (+ shared experts).

Legend: B batch, S sequence, T = B*S tokens, H hidden, E experts, K top-k.
forward(x [B, S, H]) -> y [B, S, H]. The layer's weighted balancing losses (aux_loss_coeff * aux_loss +
z_loss_coeff * z_loss, a differentiable fp32 scalar) reach the backward through autograd
(``aux_loss.attach_aux_loss`` on the output, with gradient ``aux_grad_scale``), and their detached value of the
last forward is ``aux_value`` (for logging; the shared zero when both losses are off).

Phases: ``route`` (the router: top-k ids and weights, counts, the losses); ``dispatcher`` (``dispatch.Dispatcher``:
rows sorted by expert and, under expert parallelism, sent to the ranks owning them; ``LocalDispatcher`` by default,
which keeps the fused kernels' path); ``experts`` (grouped FC1, activation, FC2 on the dispatched rows); the
dispatcher's combine (back to token order, summed over top-k). Parallelism replaces ``dispatcher`` from outside.

Load statistics: ``tokens_per_expert`` [E] fp32 (a non-persistent buffer) accumulates the
router's per-expert assignment counts (before capacity dropping) of every training-mode
forward, detached and on the device, but not during activation recompute (so a checkpointed
layer counts once). ``update_expert_bias(rate)`` applies DeepSeek's aux-loss-free update from
those counts; ``reset_stats()`` zeroes them. With data parallelism the trainer should
all-reduce ``tokens_per_expert`` before the update so that every rank moves the same bias.

Token split (tensor parallelism; ``token_split``, None on one device, set from outside by
``distributed.tensor_parallel``): each rank routes and computes the routed experts for its own slice of every
sequence. ``token_split.local(x [B, S, H])`` -> the positions this rank routes [B, S', H], and
``token_split.whole(y [B, S', H])`` -> [B, S, H] the layer's routed output for all of x's positions (with sequence
parallelism x is already this rank's slice and both are the identity). The router's losses are then this rank's
parts of the whole (``Router.token_split``, the same object), ``aux_value`` the whole value. The shared experts
see all of x (they are split by their weights instead). ``tokens_per_expert`` counts this rank's tokens.

Selective recompute (``recompute_experts``) checkpoints the dispatch -> experts -> combine call:
only its inputs x, topk_idx, topk_weight are kept; the routed-expert activations [T*K, 2I] and
[T*K, I] are recomputed in backward. The router and the shared experts are not recomputed.
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.models.mlp import MLP
from moetrain.models.moe.aux_loss import attach_aux_loss
from moetrain.models.moe.dispatch import LocalDispatcher
from moetrain.models.moe.experts import Experts
from moetrain.models.moe.router import Router
from moetrain.models.recompute import checkpoint, is_recomputing


class MoELayer(nn.Module):
    """Parameters: router.*, experts.*, shared.* (when cfg.shared_ffn_size > 0)."""

    def __init__(self, cfg):
        super().__init__()
        e = cfg.moe
        self.num_experts = e.num_experts
        self.aux_loss_coeff, self.z_loss_coeff = e.aux_loss_coeff, e.z_loss_coeff
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        shared = cfg.shared_ffn_size
        self.shared = MLP(cfg.model.hidden_size, shared, e.activation) if shared > 0 else None
        self.register_buffer("tokens_per_expert", torch.zeros(e.num_experts, dtype=torch.float32), persistent=False)
        self.recompute_experts = False
        self.dispatcher = LocalDispatcher()
        self.aux_grad_scale = 1.0  # the factor on the final loss before backward (MoETransformer.set_aux_grad_scale)
        self.aux_value = None  # detached weighted losses of the last forward
        self.token_split = None  # set by tensor parallelism (see the module doc)

    def _apply(self, fn, recurse=True):
        # Keep the counts in fp32 when the model is cast to bf16 (counts above 256 lose units).
        saved = self.tokens_per_expert
        super()._apply(fn, recurse)
        if self.tokens_per_expert.dtype != torch.float32:
            self.tokens_per_expert = saved.to(device=self.tokens_per_expert.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = self.forward_with_aux(x)
        return attach_aux_loss(y, aux, self.aux_grad_scale) if aux.requires_grad else y

    def forward_with_aux(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y [B, S, H], the weighted losses [] fp32 with grad) without attaching them: forward's parts. Sets
        ``aux_value``."""
        split = self.token_split
        xr = x if split is None else split.local(x)  # [B, S', H]: the positions this rank routes
        B, S, H = xr.shape
        xt = xr.reshape(B * S, H)
        r = self.route(xt, S)
        if self.recompute_experts:
            y = checkpoint(self.dispatcher, xt, r.topk_idx, r.topk_weight, self.experts)
        else:
            y = self.dispatcher(xt, r.topk_idx, r.topk_weight, self.experts)
        y = y.view(B, S, H)
        if split is not None:
            y = split.whole(y)
        if self.shared is not None:
            y = y + self.shared(x)
        # only the losses that are on (an add is a kernel, ~50 us of host time on the H200 host): a loss that is off is
        # the router's shared zero
        aux_on, z_on = self.router.compute_aux, self.router.compute_z
        aux = r.aux_loss + r.z_loss if aux_on and z_on else r.z_loss if z_on else r.aux_loss
        self.aux_value = aux.detach() if r.whole is None else r.whole
        return y, aux

    def route(self, xt: torch.Tensor, seq_len: int):
        """The router on xt [T, H] (RouterOutput, losses weighted by their coefficients); counts the assignments of
        a training forward into tokens_per_expert."""
        r = self.router(xt, seq_len=seq_len, aux_scale=self.aux_loss_coeff, z_scale=self.z_loss_coeff)
        if self.training and not is_recomputing():
            with torch.no_grad():
                self.tokens_per_expert.add_(r.counts)
        return r

    @torch.no_grad()
    def update_expert_bias(self, rate: float, keep: torch.Tensor | None = None) -> None:
        """expert_bias += rate * sign(mean count - count): overloaded experts down, underloaded up.
        No-op without moe.expert_bias. The counts are kept (for metrics) until ``reset_stats``.
        ``keep`` (fp32 [], optional): 1 apply, 0 leave the bias (a skipped step decided on the device)."""
        bias = self.router.expert_bias
        if bias is None:
            return
        counts = self.tokens_per_expert
        step = rate * torch.sign(counts.mean() - counts)
        bias.add_(step if keep is None else step * keep)

    @torch.no_grad()
    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()

    @torch.no_grad()
    def load_imbalance(self) -> torch.Tensor:
        """max / mean of the accumulated counts (fp32 device scalar; 1 = balanced, 0 = no tokens yet)."""
        counts = self.tokens_per_expert
        return counts.max() / counts.mean().clamp(min=1e-12)
