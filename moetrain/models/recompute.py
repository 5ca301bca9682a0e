"""Activation checkpointing that knows whether it is recomputing.

``checkpoint(fn, *args)`` is torch.utils.checkpoint (non-reentrant) around ``fn``; while the
backward pass re-runs ``fn``, ``is_recomputing()`` is True. MoE layers use it to accumulate
their per-expert token counts once per forward, not again during recompute.

A counter per thread: the recompute runs ``fn`` on the thread that unpacks the saved tensors (autograd's
device thread on CUDA), and the MoE layers it calls ask on that same thread; a forward running meanwhile on
another thread (``moe.overlap_a2a``'s overlapped pairs) is not recomputing.
"""

from __future__ import annotations

import threading

import torch
import torch.utils.checkpoint

_state = threading.local()


def is_recomputing() -> bool:
    return getattr(_state, "depth", 0) > 0


def checkpoint(fn, *args):
    """Run ``fn(*args)`` without keeping its intermediate activations; they are recomputed in backward.

    Only checkpoints when autograd records (grad enabled); otherwise a plain call.
    The RNG state is preserved, so random routing (force_balance=uniform) replays identically.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    calls = 0

    def run(*a):
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*a)
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            return fn(*a)
        finally:  # also on torch's early-stop exception
            _state.depth -= 1

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
