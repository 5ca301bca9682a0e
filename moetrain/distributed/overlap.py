"""``moe.overlap_a2a``: DualPipe-V's overlapped pairs run concurrently, one micro-batch's expert all-to-all in
flight while the other micro-batch computes.

In its steady state torch's ``ScheduleDualPipeV`` pairs the forward of one local stage (micro-batch i) with the
full backward of the other local stage (micro-batch j) in one OVERLAP_F_B action, and runs the two in turn. Here
(``install``) that action runs them at once: the backward on a worker thread, the forward on the calling thread, so
that while one waits on its dispatch or combine the other launches compute. What makes that safe:

- collectives: the two local stages' MoE layers dispatch over two process groups of the same expert-parallel
  ranks (``chunk_ep_groups``), so the two threads never issue collectives on one communicator and each group sees
  its collectives in the same order on every rank (every rank runs the same actions). Under pipeline parallelism
  FSDP2 keeps a stage's parameters unsharded for the whole step (the schedule unshards each stage before its first
  compute; blocks do not reshard after forward), so no FSDP collective runs inside a pair; tensor parallelism
  would, and is refused with overlap (``Config.check``);
- CUDA streams: the pair's forward runs on a stream of its stage's own (autograd runs a backward node on its
  forward's stream, so the concurrent backward is on another stream), waiting first for the current stream and
  leaving an event the current stream waits on; its outputs are marked as used by the current stream;
- host state the two threads share: the recompute flag is per thread (``models.recompute``); the deferred weight
  gradients' collector is only added to by the backward; a stage's module is used by one thread at a time (a
  pair's two stages differ).

What each sub-action does is the schedule's own bookkeeping for a FORWARD and a FULL_BACKWARD action, repeated
here for the pair: wait for the received input or gradient, compute, compute the loss on the last stage, hand the
output or input gradient to the neighbouring stage on this rank. On the CPU (gloo) the result is exactly the
sequential one; the speed is measured on several GPUs.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch


def chunk_ep_groups(meshes) -> list:
    """Two process groups over this rank's expert-parallel ranks (a collective: every rank calls it): the MoE
    dispatchers of its first and second local stage. The ep ranks are the innermost dims of the root mesh, so the
    rows of the rank grid reshaped to [-1, ep] are the ep groups."""
    import torch.distributed as dist

    rows = meshes.root.mesh.reshape(-1, meshes.layout.ep).tolist()
    groups = []
    for _ in range(2):
        mine, _ = dist.new_subgroups_by_enumeration(rows)
        groups.append(mine)
    return groups


class OverlappedPair:
    """The OVERLAP_F_B function registered on the schedule (see the module doc)."""

    def __init__(self, schedule, device: torch.device):
        self.schedule = schedule
        self.device = device
        self.stages = {stage.stage_index: stage for stage in schedule._stages}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetrain-overlap")
        self.streams = {}

    def __call__(self, action, ctx) -> None:
        forward, backward = action.sub_actions
        if forward.stage_index == backward.stage_index:
            raise RuntimeError(f"moe.overlap_a2a: an overlapped pair on one stage ({action}); the dispatchers' "
                               "process groups are per stage")
        pending = self.pool.submit(self._backward, backward, ctx)
        try:
            self._forward(forward, ctx)
        finally:
            pending.result()
        if self.device.type == "cuda":  # the backward's kernels ran on its forward's stream
            current = torch.cuda.current_stream(self.device)
            for side in self.streams.values():
                current.wait_stream(side)

    def _stream(self, stage_index: int):
        if self.device.type != "cuda":
            return contextlib.nullcontext(), None
        if stage_index not in self.streams:
            self.streams[stage_index] = torch.cuda.Stream(self.device)
        side, current = self.streams[stage_index], torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        return torch.cuda.stream(side), (side, current)

    def _forward(self, action, ctx) -> None:
        from torch.distributed.pipelining.schedules import _wait_batch_p2p

        sched, idx, mb = self.schedule, action.stage_index, action.microbatch_index
        stage = self.stages[idx]
        if not stage.is_first and idx - 1 not in self.stages:
            _wait_batch_p2p(sched.fwd_recv_ops.pop((idx, mb)))
        scope, streams = self._stream(idx)
        with scope:
            output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
            sched._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if streams is not None:
            side, current = streams
            current.wait_stream(side)
            for t in _tensors(output):
                t.record_stream(current)
        if idx + 1 in self.stages:
            self.stages[idx + 1].set_local_fwd_input(output, mb)

    def _backward(self, action, ctx) -> None:
        from torch.distributed.pipelining.schedules import _wait_batch_p2p

        sched, idx, mb = self.schedule, action.stage_index, action.microbatch_index
        stage = self.stages[idx]
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not stage.is_last and idx + 1 not in self.stages:
            _wait_batch_p2p(sched.bwd_recv_ops.pop((idx, mb)))
        loss = sched._maybe_get_loss(stage, mb)
        sched.backward_counter[idx] += 1
        last = sched.backward_counter[idx] == sched._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
        if idx - 1 in self.stages:
            self.stages[idx - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [t for t in output if isinstance(t, torch.Tensor)] if isinstance(output, (tuple, list)) else []


def install(schedule, device: torch.device) -> OverlappedPair:
    """Register the overlapped pair on a DualPipe-V schedule; RuntimeError naming what this torch lacks."""
    try:
        from torch.distributed.pipelining.schedules import OVERLAP_F_B
    except ImportError:
        raise RuntimeError("moe.overlap_a2a needs torch.distributed.pipelining's OVERLAP_F_B actions "
                           f"(torch {torch.__version__} has none); set moe.overlap_a2a=false") from None
    needed = ("register_custom_function", "fwd_recv_ops", "bwd_recv_ops", "backward_counter", "_maybe_get_loss",
              "_maybe_compute_loss")
    missing = [n for n in needed if not hasattr(schedule, n)]
    if missing:
        raise RuntimeError(f"moe.overlap_a2a: torch {torch.__version__}'s pipeline schedule lacks {missing}; set "
                           "moe.overlap_a2a=false")
    pair = OverlappedPair(schedule, device)
    schedule.register_custom_function(OVERLAP_F_B, pair)
    return pair
