"""One optimizer step's parts, and the strategies that run them.

A step (``Trainer.train_step``): zero the gradients and MoE counts; forward + backward of each micro-batch, the
loss terms averaged over them on the device (``Trainer.forward_backward``); then the update: global grad norm,
a skip where the loss or the norm is not finite, clipping, AdamW, the expert-bias update; and one host read of
everything the step reports (``StepResult``). That read is the step's only host sync, in every strategy.

A strategy runs the two phases, ``forward_backward`` and ``update``:
- ``EagerStep``: the trainer's forward + backward; the update decided on the host: the read comes first (loss
  terms, grad norm, load imbalance), then clip, AdamW and the expert-bias update run where both are finite. Where
  some parameter's update takes AdamW's explicit per-tensor path, which reads the step count on the host
  (optimizer state that mixes precisions without the Triton kernel: on the CPU, or without triton).
- ``DeviceUpdateStep``: the trainer's forward + backward; the update with no host in the loop
  (``device_update``: clip and skip inside the Triton AdamW kernel or torch's fused one); the read comes after it.
  Where every parameter takes one of those (``PrecisionAwareAdamW.explicit_slots()`` empty): on CUDA with triton,
  any optimizer state.
- ``GraphReplayStep`` (graphed_step.py): both phases replayed from CUDA graphs (train.cuda_graph).
``Trainer.step_mode`` chooses among them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input_ids, labels): int64 [micro_batch_size, seq_length]


@dataclass(frozen=True)
class LossTerms:
    """A micro-batch's loss terms, or a step's mean over its micro-batches: one detached fp32 [4] device tensor
    (a step adds one tensor per micro-batch and reads one), in the order loss, lm_loss, aux_loss, mtp_loss (0.0
    without MTP)."""

    values: torch.Tensor

    @property
    def loss(self) -> torch.Tensor:
        return self.values[0]

    @property
    def lm_loss(self) -> torch.Tensor:
        return self.values[1]

    @property
    def aux_loss(self) -> torch.Tensor:
        return self.values[2]

    @property
    def mtp_loss(self) -> torch.Tensor:
        return self.values[3]


@dataclass
class StepResult:
    """What one optimizer step reports, as host numbers (read from the device in one transfer)."""

    loss: float  # the mean over the step's micro-batches of each term
    lm_loss: float
    aux_loss: float
    mtp_loss: float  # 0.0 without MTP
    grad_norm: float  # global L2 norm of the gradients, before clipping
    skipped: bool  # the loss or the grad norm was not finite: no update was applied
    load_imbalance: list[float] = field(default_factory=list)  # max/mean tokens per expert, per MoE layer
    lr: float = 0.0
    tokens: int = 0  # tokens the step trained on
    peak_mem_fwd_bwd_gib: float = 0.0  # peak memory of the forward + backward phase alone

    @classmethod
    def from_device_vector(cls, values: list[float], lr: float) -> StepResult:
        """From ``device_update``'s vector read to the host: [loss terms (4), grad norm, skipped, imbalance...]."""
        loss, lm_loss, aux_loss, mtp_loss, norm, skipped = values[:6]
        return cls(loss, lm_loss, aux_loss, mtp_loss, norm, skipped != 0.0, values[6:], lr)


def forward_backward(model, input_ids: torch.Tensor, labels: torch.Tensor, accum: int) -> torch.Tensor:
    """One micro-batch as the trainer runs it, eagerly or inside a CUDA graph: the forward, the backward of
    loss / accum; returns the loss terms [4] fp32 (loss, lm_loss, aux_loss, mtp_loss; 0 without MTP)."""
    out = model(input_ids, labels)
    (out.loss / accum).backward()
    mtp = out.mtp_loss if out.mtp_loss is not None else torch.zeros((), device=input_ids.device)
    # detached: a tensor with a grad_fn would keep the micro-batch's autograd graph (its nodes) alive
    return torch.stack([out.loss.float(), out.lm_loss, out.aux_loss, mtp]).detach()


@torch.no_grad()
def device_update(model, optimizer, sums: torch.Tensor, lr: float | torch.Tensor, clip: float,
                  expert_bias_rate: float | None) -> torch.Tensor:
    """A step's update with no host in the loop (``DeviceUpdateStep``, and the graph's tail): grad norm, skip on
    a non-finite loss (sums[0]) or norm, clip and AdamW (``step_on_device``), the expert-bias update masked on a
    skip. Returns the fp32 vector for the host: [loss terms (sums, 4), grad norm, skipped (1.0 / 0.0), load
    imbalance per MoE layer]."""
    norm = optimizer.grad_norm().to(sums.device)
    keep = (torch.isfinite(sums[0]) & torch.isfinite(norm)).float()
    optimizer.step_on_device(lr, norm, keep, clip)
    if expert_bias_rate is not None:
        model.update_expert_bias(expert_bias_rate, keep)
    imbalance = model.load_imbalance()
    parts = [sums, norm.reshape(1), (1.0 - keep).reshape(1)]
    return torch.cat(parts + ([imbalance.float()] if imbalance is not None else []))


ForwardBackward = Callable[[Iterable[MicroBatch]], LossTerms]


class StepStrategy(Protocol):
    """How a step's two phases run. ``forward_backward`` gets the step's micro-batches and the trainer's own
    ``forward_backward`` (``eager``), which it may run or replace; ``update`` applies (or skips) the update and
    returns the step's numbers, read to the host once."""

    def forward_backward(self, micro_batches: Iterable[MicroBatch], eager: ForwardBackward) -> LossTerms: ...

    def update(self, losses: LossTerms, lr: float) -> StepResult: ...


class EagerStep:
    """Forward + backward through the trainer's ``forward_backward``; the update decided on the host after the
    step's one read (see the module doc).

    ``clip``: optim.clip_grad (0: off); ``expert_bias_rate``: moe.expert_bias_update_rate, or None where no
    expert bias is learned."""

    def __init__(self, model, optimizer, clip: float, expert_bias_rate: float | None):
        self.model, self.optimizer = model, optimizer
        self.clip, self.expert_bias_rate = clip, expert_bias_rate

    def forward_backward(self, micro_batches: Iterable[MicroBatch], eager: ForwardBackward) -> LossTerms:
        """The step's forward + backward; ``eager`` is the trainer's own (``Trainer.forward_backward``)."""
        return eager(micro_batches)

    def update(self, losses: LossTerms, lr: float) -> StepResult:
        grad_norm = self.optimizer.grad_norm()
        imbalance = self.model.load_imbalance()
        device = losses.values.device
        # One host sync per step for everything we log.
        host = torch.cat([losses.values, grad_norm.reshape(1).to(device)]
                         + ([imbalance.float()] if imbalance is not None else [])).tolist()
        loss, lm_loss, aux_loss, mtp_loss, norm = host[:5]
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            if self.clip > 0 and norm > self.clip:
                self.optimizer.scale_grads(self.clip / (norm + 1e-6))
            self.optimizer.step(lr)
            if self.expert_bias_rate is not None:
                self.model.update_expert_bias(self.expert_bias_rate)
        return StepResult(loss, lm_loss, aux_loss, mtp_loss, norm, not finite, host[5:], lr)


class DeviceUpdateStep(EagerStep):
    """Forward + backward through the trainer's ``forward_backward``; the update on the device
    (``device_update``), read afterwards (see the module doc)."""

    def update(self, losses: LossTerms, lr: float) -> StepResult:
        vector = device_update(self.model, self.optimizer, losses.values, lr, self.clip, self.expert_bias_rate)
        return self.read(vector, lr)

    def read(self, vector: torch.Tensor, lr: float) -> StepResult:
        """The step's one host read of ``device_update``'s vector; counts an applied update on the host."""
        result = StepResult.from_device_vector(vector.tolist(), lr)
        if not result.skipped:
            self.optimizer.count_step()
        return result
