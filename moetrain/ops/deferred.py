"""Deferred weight gradients: the backward split that zero-bubble pipeline schedules use (input gradients now,
weight gradients later).

    with moetrain.ops.defer_weight_grads() as pending:
        loss.backward()      # our ops compute their input gradients and queue their weight gradients
    ...                      # e.g. send the stage's input gradient on first
    pending.run()            # computes the queued weight gradients and delivers them

With torch.distributed.pipelining, ``PipelineStage(..., dw_builder=pending.take)`` inside the context around the
schedule's step: the stage calls dw_builder() right after each micro-batch's backward, and ``take`` returns a runner
of exactly what that backward queued, which the schedule's weight step calls.

Which ops defer: our autograd functions on the expert and router path, each the one GEMM that computes a weight's
gradient: the grouped GEMM (``grouped_gemm`` with the triton, torch and auto backends: w), FC1 of the fused path (w1),
FC2 with the combine (w2), and the router's tensor-core GEMM (its weight). Everything else, plain PyTorch layers and
the reference backend's plain ops included, computes its weight gradients in the backward as usual. A queued
gradient is the very call the backward would have made (same kernel, same operands), made later: deferral adds no
GEMM and changes no number. Outside the context nothing is queued and the backward is unchanged.

Delivery: ``torch.autograd.backward`` from the weight's autograd edge (the node's input edge, not the saved tensor,
so saved-tensor hooks and activation recompute do not matter): a leaf accumulates into .grad (its hooks run then),
a non-leaf weight (a cast, an FSDP view) passes the gradient on to its leaf. Each gradient is computed and delivered
in turn, in backward order, so at most one is held beyond the .grad it lands in. Until then each queued gradient
keeps its operands alive (the output gradient and the saved input, e.g. FC2's dy [M, H] and a [M, I]).

Only a backward that accumulates into .grad (``.backward()``, ``torch.autograd.backward``) defers. Inside the context,
where the engine says that the current backward will not use a weight's gradient (``backward(inputs=...)`` without
that weight, ``torch.autograd.grad`` through a non-leaf weight it does not ask for), the GEMM is skipped. Under ``torch.autograd.grad`` a leaf weight's gradient is computed at once, never queued: the engine does not
tell a node whether that call wants it (torch's stage_backward_input and PipelineStage's metadata inference run such
calls). Not supported: ``torch.autograd.grad`` asking for the leaf behind a non-leaf weight (a cast parameter)
inside the context: that gradient would be queued instead of returned.

Caveats: in the first backward autograd still visits a deferred weight's accumulator, with no gradient (a gradient
hook sees None there), so gradient reduction must wait for ``run``, as with any split schedule. Inside a
torch.compile'd region nothing is deferred: the compiled backward is one graph that computes all its gradients.
The active collector is process-wide, not thread-local: the autograd engine runs CUDA backward work on its own
device threads.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
from torch.autograd.graph import GradientEdge

_active: PendingWeightGrads | None = None


class PendingWeightGrads:
    """The weight gradients queued by backward passes inside ``defer_weight_grads``: (autograd edge of the weight,
    a function computing its gradient) pairs, in the order the backward reached them."""

    def __init__(self):
        self._work: list[tuple[GradientEdge, Callable[[], torch.Tensor]]] = []

    def __len__(self) -> int:
        return len(self._work)

    def add(self, edge: GradientEdge, compute: Callable[[], torch.Tensor]) -> None:
        self._work.append((edge, compute))

    def take(self) -> Callable[[], None]:
        """A runner of everything queued so far (and nothing queued later): the ``dw_builder`` of a PipelineStage."""
        work, self._work = self._work, []
        return lambda: _deliver(work)

    def run(self) -> None:
        """Compute and deliver every queued gradient (see the module docstring); the queue is empty afterwards."""
        _deliver(self._work)

    def __del__(self):
        if self._work:
            warnings.warn(f"moetrain: {len(self._work)} deferred weight gradients were never run (their weights "
                          "got no gradient from them): call run() after the backward", RuntimeWarning, stacklevel=1)


def _deliver(work: list) -> None:
    while work:
        edge, compute = work.pop(0)  # popped first: its operands are freed once its gradient is delivered
        with torch.no_grad():  # as in the backward that queued it
            grad = compute()
        torch.autograd.backward([edge], [grad])


@contextlib.contextmanager
def defer_weight_grads(pending: PendingWeightGrads | None = None):
    """Within this context the backward of our expert and router ops queues their weight gradients on ``pending``
    (a new PendingWeightGrads by default), which the context yields; nothing runs them on exit."""
    global _active
    pending = PendingWeightGrads() if pending is None else pending
    previous, _active = _active, pending
    try:
        yield pending
    finally:
        _active = previous


def weight_grad(ctx, index: int, compute: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """For a custom autograd node's backward (``ctx``): the gradient of its weight, ``compute()``, now; or, inside
    ``defer_weight_grads`` and outside compilation, None now and ``compute`` queued (None without computing it where
    the engine says that this backward does not use it). ``index``: the weight's position
    among the tensor arguments of the node's apply (its autograd input edge)."""
    if torch.compiler.is_compiling() or _active is None:
        return compute()
    node, input_nr = ctx.next_functions[index]
    try:
        if not torch._C._will_engine_execute_node(node):
            return None
    except RuntimeError:
        # a leaf's accumulator while torch.autograd.grad runs (the engine refuses to say): its gradient, if asked for,
        # is returned to that call, so it is computed now
        return compute()
    _active.add(GradientEdge(node, input_nr), compute)
    return None
