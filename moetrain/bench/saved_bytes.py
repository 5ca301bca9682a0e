"""The bytes autograd keeps for backward: what the planner's activation terms (``plan.activations``) must equal.

    tracker = StorageTracker(skip={storage pointers of the parameters, shared tables, ...})
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
        out = block(x, ...)
    tracker.alive_bytes()

Each saved tensor's storage is counted once while any tensor recorded on it is alive (the graph holds what it
saved; the nodes of dead branches free theirs). A DTensor counts its local shard, a collective's pending output
(AsyncCollectiveTensor) its data. ``block_saved_bytes`` measures one decoder block this way (``seeded_block`` builds
it), its activation checkpoints' inputs included. Used by the planner's tests (tests/plan/test_activations.py and, on gloo ranks
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


def storage(t) -> int:
    """The data pointer of t's storage (a DTensor's local shard's)."""
    return getattr(t, "_local_tensor", t).untyped_storage().data_ptr()


def seeded_block(cfg, moe: bool, window, mode: str, dtype):
    """A DecoderLayer to measure: norms 1, other weights normal(0, 0.05) from seed 0, in ``dtype``, recompute
    ``mode``."""
    import torch

    from moetrain.models.transformer import DecoderLayer

    torch.manual_seed(0)
    blk = DecoderLayer(cfg, moe, window)
    with torch.no_grad():
        for name, p in blk.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.05)
    blk.to(dtype)
    blk.set_recompute(mode)
    return blk


def block_saved_bytes(cfg, blk, x) -> int:
    """The bytes ``blk`` (a DecoderLayer of ``cfg``, possibly tensor-parallel) keeps for backward on input x
    [B, S_local, H]: its forward under the tracker (parameters and the RoPE tables of cfg.train.seq_length positions
    skipped), the inputs of its activation checkpoints recorded too (what a checkpoint keeps); then the backward, so
    that the graph is complete (the aux losses through y; under tensor parallelism every rank takes part in its
    collectives)."""
    import torch

    import moetrain.models.attention as attention_mod
    import moetrain.models.moe.layer as layer_mod
    from moetrain.models import recompute
    from moetrain.models.rope import RopeParams

    m = cfg.model
    rope_dim = m.qk_rope_head_dim if m.attention_type == "mla" else cfg.attn_head_dim
    cos, sin = RopeParams.from_model_config(m, rope_dim).tables(cfg.train.seq_length)
    tracker = StorageTracker({storage(p) for p in blk.parameters()} | {storage(cos), storage(sin)})

    def recording_checkpoint(fn, *args):
        for a in args:
            if isinstance(a, torch.Tensor):
                tracker.record(a)
        return recompute.checkpoint(fn, *args)

    saved = attention_mod.checkpoint, layer_mod.checkpoint
    attention_mod.checkpoint = layer_mod.checkpoint = recording_checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            y = recording_checkpoint(blk, x, cos, sin) if blk.recompute == "full" else blk(x, cos, sin)
    finally:
        attention_mod.checkpoint, layer_mod.checkpoint = saved
    kept = tracker.alive_bytes()  # storages the autograd graph (or a checkpoint) still holds
    y.float().sum().backward()
    return kept
