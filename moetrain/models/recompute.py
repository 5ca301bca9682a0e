"""Activation checkpointing that knows whether it is recomputing.

``checkpoint(fn, *args)`` is torch.utils.checkpoint (non-reentrant) around ``fn``; while the
backward pass re-runs ``fn``, ``is_recomputing()`` is True. MoE layers use it to accumulate
their per-expert token counts once per forward, not again during recompute.

A process-wide counter, not a thread-local: autograd may run the recompute on its own device
thread.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

_recompute_depth = 0


def is_recomputing() -> bool:
    return _recompute_depth > 0


def checkpoint(fn, *args):
    """Run ``fn(*args)`` without keeping its intermediate activations; they are recomputed in backward.

    Only checkpoints when autograd records (grad enabled); otherwise a plain call.
    The RNG state is preserved, so random routing (force_balance=uniform) replays identically.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    calls = 0

    def run(*a):
        global _recompute_depth
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*a)
        _recompute_depth += 1
        try:
            return fn(*a)
        finally:  # also on torch's early-stop exception
            _recompute_depth -= 1

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
