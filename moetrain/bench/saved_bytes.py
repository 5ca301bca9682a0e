"""The bytes autograd keeps for backward: what the planner's activation terms (``plan.activations``) must equal.

    tracker = StorageTracker(skip={storage pointers of the parameters, shared tables, ...})
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
        out = block(x, ...)
    tracker.alive_bytes()

Each saved tensor's storage is counted once while any tensor recorded on it is alive (the graph holds what it
saved; the nodes of dead branches free theirs). A DTensor counts its local shard, a collective's pending output
(AsyncCollectiveTensor) its data. Used by the planner's tests (tests/plan/test_activations.py and, on gloo ranks
under tensor parallelism, tests/distributed/test_activations_tp.py).
"""

from __future__ import annotations

import gc
import weakref


class StorageTracker:
    def __init__(self, skip: set):
        self.skip = skip
        self.groups: list[tuple[int, int, list]] = []  # (data_ptr, nbytes, weakrefs)

    def record(self, t) -> None:
        t = getattr(t, "_local_tensor", t)  # a DTensor: its local tensor
        t = getattr(t, "elem", t)  # an AsyncCollectiveTensor (a collective's output): its data
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return
        for p, _, refs in reversed(self.groups):
            if p == ptr and any(r() is not None for r in refs):
                refs.append(weakref.ref(t))
                return
        self.groups.append((ptr, t.untyped_storage().nbytes(), [weakref.ref(t)]))

    def pack(self, t):
        """The saved_tensors_hooks pack hook: records t, returns a detached alias (returning t itself would make a
        node that saves its own output hold that output, a reference cycle autograd otherwise avoids)."""
        alias = t.detach()
        self.record(alias)
        return alias

    def alive_bytes(self) -> int:
        gc.collect()
        return sum(n for _, n, refs in self.groups if any(r() is not None for r in refs))
