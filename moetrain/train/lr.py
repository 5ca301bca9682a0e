"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr (lr / 10 unless set)."""

from __future__ import annotations

import math

from moetrain.config.schema import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a run of ``total_steps``.

    Warmup ramps linearly so that step warmup_steps - 1 reaches the peak; decay then runs over
    ``decay_steps`` (default: the rest of the run) and holds ``optim.min_lr_value`` afterwards. A warmup
    longer than the run only ramps (the peak is never reached); every value lies in [0, lr].
    """
    warmup = optim.warmup_steps
    if step < warmup:
        return optim.lr * (step + 1) / warmup
    if optim.decay == "constant":
        return optim.lr
    decay_steps = optim.decay_steps or max(total_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    if optim.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    low = optim.min_lr_value
    return low + (optim.lr - low) * shape
