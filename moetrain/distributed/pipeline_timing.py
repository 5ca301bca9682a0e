"""Per-rank timing of the pipeline's forward, backward and weight-gradient steps (``profile.dump_pp_data``).

``StageTimer(pipes, device)`` wraps the ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` methods of this rank's torch ``PipelineStage`` objects (on the instances, nothing
global). While a step is recorded (``start_step`` .. ``end_step``) each call adds one op:
``{"kind": "F" | "B" | "W", "micro_batch": i, "stage": global stage index, "chunk": the stage's position on this
rank, "start": s, "end": s}``, seconds since the step's start. "B" is the input-gradient step where the schedule
defers the weight gradients (zero_bubble, dualpipev: a "W" follows), else the whole backward.

Clocks: on CUDA, events on the current stream around each call (the ops' device times; read once at the step's end);
on the CPU, the host clock. Each rank's step starts right after a barrier over the pipeline group, so the ranks'
zeros agree to within the barrier's skew. Outside recorded steps the wrappers only test a flag.
"""

from __future__ import annotations

import functools
import time

import torch


class StageTimer:
    def __init__(self, pipes: list, device: torch.device):
        self.device = device
        self.recording = False
        self._marks: list[tuple[dict, object, object]] = []  # (op, start mark, end mark)
        self._zero = None
        for chunk, pipe in enumerate(pipes):
            for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                                 ("backward_weight_one_chunk", "W")):
                self._wrap(pipe, chunk, method, kind)

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _wrap(self, pipe, chunk: int, method: str, kind: str) -> None:
        inner = getattr(pipe, method)

        @functools.wraps(inner)
        def timed(mb_index, *args, **kwargs):
            if not self.recording:
                return inner(mb_index, *args, **kwargs)
            start = self._mark()
            out = inner(mb_index, *args, **kwargs)
            op = {"kind": kind, "micro_batch": int(mb_index), "stage": pipe.stage_index, "chunk": chunk}
            self._marks.append((op, start, self._mark()))
            return out

        setattr(pipe, method, timed)

    def start_step(self, pp_group) -> None:
        """Start recording a step (a collective over ``pp_group``: the barrier that aligns the ranks' zeros)."""
        import torch.distributed as dist

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=pp_group)
        self._marks = []
        self._zero = self._mark()
        self.recording = True

    def end_step(self) -> list[dict]:
        """Stop recording; the step's ops in start order, times in seconds since its start."""
        self.recording = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            since = lambda mark: self._zero.elapsed_time(mark) / 1e3  # noqa: E731 (ms -> s)
        else:
            since = lambda mark: mark - self._zero  # noqa: E731
        ops = [dict(op, start=since(a), end=since(b)) for op, a, b in self._marks]
        self._marks = []
        return sorted(ops, key=lambda op: op["start"])
