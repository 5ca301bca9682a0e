"""``train.cuda_graph``: a training step as two CUDA graph replays per micro-batch and step.

Why: a step whose kernels are short waits on the host. The tiny preset's step on an H200 is ~1,500 eager
launches, each waiting on Python (38-72 ms a step on the hosts we were lent, a few ms of GPU work), and an
MoE layer launches ~30 kernels, some of them short. A replay launches a whole captured sequence at once.

Two graphs, captured on the step after ``WARMUP_STEPS`` eager ones (which autotune the Triton kernels, let
moe.backend=auto time its choices and settle the allocator):
- the micro-batch: ``model(input_ids, labels)``, the backward of ``loss / accum``, and the loss terms added
  into a static fp32 [4] sum (loss, lm, aux, mtp; divided by accum). The inputs are static [B, S] int64
  buffers on the device that each micro-batch is copied into. Replayed once per micro-batch.
- the step tail: the global grad norm, the decision to skip (a non-finite loss or norm), clipping, the
  AdamW update (``PrecisionAwareAdamW.step_on_device``: learning rate from a device scalar, clip and skip
  inside the Triton AdamW kernel, or torch's fused one), the expert-bias update (masked on a skipped step), and one
  static fp32 vector
  for the host: [loss terms (4), grad norm, skipped, load imbalance per MoE layer]. Replayed once per step.
``GraphReplayStep`` is the trainer's step strategy around them. The host per step: zero the gradients and
MoE counts and the loss sum, copy each micro-batch in, set the learning rate, replay, and one read of that
vector (the step's only sync) for metrics and the skip count.
With the tail captured, the host's speed hardly enters the step: eagerly the optimizer, norm and clip alone
are ~100 launches, which left the step of tiny-wide-graph with only the micro-batch captured at 6.2 / 7.3 ms
on two hosts whose GPU work was the same. Evaluation and checkpoints stay eager.

Gradients: where a parameter has a separate main-grad buffer (optim.main_grads_dtype differs from its
dtype) the hook captured with the backward adds each replay's gradient into it, so micro-batches
accumulate as in eager mode. A parameter without one gets its gradient written (not added) by each
replay, into the buffer the capture allocated; the step hands that buffer back as ``param.grad``, and
with such parameters a step may hold only one micro-batch.

Streams: the whole run, eager steps included, runs on one non-default stream (``loop_stream``) and the graph
is captured on it. The eager steps are then the warm-up torch asks for before a capture, on the capture's own
stream, and lazily made per-stream state exists once: cuBLAS keeps a 64 MiB workspace per stream, so warming up
on a side stream and capturing on a third (torch.cuda.graph's default) held three of them and put the capture
step's peak 0.1 GiB above the eager steps' (tiny-wide-graph on the H200).

Capturing does not run the work: the capture step replays right after capturing. A host sync, a
host read of routing-dependent values or a CPU tensor inside the forward fails the capture loudly.
Shapes: [micro_batch_size, seq_length] are fixed for a run; each graph is captured once. Every parameter's
update must run on the device: the Triton AdamW kernel takes any optimizer state (on CUDA, triton installed),
torch's fused AdamW one dtype for the weights, their gradients and both moments; the explicit mixed-precision path
reads the step count on the host. The kernel's tensor tables are made before the tail's capture
(``PrecisionAwareAdamW.prepare_device_step``), from the gradient buffers the micro-batch capture made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from moetrain.errors import UserError
from moetrain.train.steps import (
    DeviceUpdateStep,
    ForwardBackward,
    LossTerms,
    MicroBatch,
    StepResult,
    device_update,
    forward_backward,
)

WARMUP_STEPS = 2


@contextlib.contextmanager
def loop_stream(device: torch.device, enabled: bool = True):
    """Run the block on a fresh non-default CUDA stream (ordered after the current stream's work, and the current
    stream after the block's); a no-op when not ``enabled`` or off CUDA. The graphed trainer runs its loop here."""
    if not enabled or device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.current_stream(device).wait_stream(stream)


def on_side_stream(fn, device: torch.device):
    """``fn()`` on a fresh CUDA stream (``loop_stream``); returns its result. Warm-ups before a capture on
    torch.cuda.graph's own stream run there (measure, bench moe): torch's CUDA-graph notes ask for it (state
    that libraries create lazily per stream, such as cuBLAS workspaces, must exist before capture)."""
    with loop_stream(device):
        return fn()


class GraphedStep:
    """A training step's forward + backward and its update as CUDA graphs (see the module doc).

    Per step: ``begin_step()``; ``run(ids, labels)`` per micro-batch; ``finish(lr)`` -> the host vector."""

    def __init__(self, model, optimizer, accum: int, micro_batch_size: int, seq_length: int, device: torch.device,
                 clip_grad: float, expert_bias_rate: float | None):
        slots = optimizer.slots
        plain = [s.param for s in slots if s.main_grad is None]
        if plain and accum > 1:
            raise UserError(
                f"train.cuda_graph with {accum} micro-batches per step needs separate main grads for every parameter "
                f"({len(plain)} have none: optim.main_grads_dtype equals their dtype), since a replay writes "
                "their gradients rather than adding to them; use one micro-batch per step "
                "(train.global_batch_size = micro_batch_size x dp) or fp32 main grads")
        explicit = optimizer.explicit_slots()
        if explicit:
            raise UserError(
                f"train.cuda_graph captures the optimizer step, which for mixed-precision optimizer state needs the "
                f"Triton AdamW kernel (CUDA and the triton package; {len(explicit)} parameters mix dtypes, e.g. "
                f"{explicit[0]}): install triton, or set optim.exp_avg_dtype / optim.exp_avg_sq_dtype / "
                "optim.main_grads_dtype to the master weights' dtype, or train.cuda_graph=false")
        self._require_cuda(device)
        self.model, self.optimizer, self.accum = model, optimizer, accum
        self.clip_grad, self.expert_bias_rate = clip_grad, expert_bias_rate
        self._plain = plain
        self._plain_grads: list[torch.Tensor | None] = []
        self.input_ids = torch.zeros(micro_batch_size, seq_length, dtype=torch.int64, device=device)
        self.labels = torch.zeros_like(self.input_ids)
        self.sums = torch.zeros(4, device=device)  # loss terms over the step's micro-batches, / accum
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.host: torch.Tensor | None = None  # the tail's output vector (static)
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}

    @staticmethod
    def _require_cuda(device: torch.device) -> None:
        if device.type != "cuda":
            raise UserError(f"train.cuda_graph needs a CUDA device (training runs on {device}); "
                            "set train.cuda_graph=false")

    # ---- what the graphs hold -----------------------------------------------------------

    def _micro_batch(self) -> None:
        terms = forward_backward(self.model, self.input_ids, self.labels, self.accum)
        self.sums.add_(terms / self.accum)

    def _tail(self) -> None:
        self.host = device_update(self.model, self.optimizer, self.sums, self.lr, self.clip_grad,
                                  self.expert_bias_rate)

    # ---- per step -----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Zero the loss sum (the trainer zeroes gradients and MoE counts, as eagerly)."""
        self.sums.zero_()

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """One micro-batch: copy it (CPU or device [B, S] int64) into the static inputs, replay the micro-batch
        graph (captured on the first call, on the current stream: the one the warm-up steps ran on)."""
        if tuple(input_ids.shape) != tuple(self.input_ids.shape):
            raise ValueError(f"micro-batch {tuple(input_ids.shape)} differs from the captured "
                             f"{tuple(self.input_ids.shape)}")
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        first = "micro_batch" not in self._graphs
        if first:
            for p in self._plain:
                p.grad = None  # the capture's backward allocates them in the graph's memory
        self._launch("micro_batch", self._micro_batch)
        if first:
            self._plain_grads = [p.grad for p in self._plain]
        for p, g in zip(self._plain, self._plain_grads):
            if p.grad is None:  # a replay wrote into the captured buffer behind autograd's back
                p.grad = g

    def finish(self, lr: float) -> torch.Tensor:
        """The step's update at learning rate ``lr``; returns the fp32 vector [loss, lm_loss, aux_loss, mtp_loss,
        grad norm, skipped (1.0 / 0.0), load imbalance per MoE layer] (static: read it before the next step)."""
        self.optimizer.prepare_device_step(self.lr.device)  # its counter and kernel tables made before the capture
        self.lr.fill_(lr)
        self._launch("tail", self._tail)
        return self.host

    def _launch(self, name: str, fn) -> None:
        """Replay graph ``name``, capturing ``fn`` into it on first use."""
        graph = self._graphs.get(name)
        if graph is None:
            stream = torch.cuda.current_stream(self.input_ids.device)
            if stream == torch.cuda.default_stream(self.input_ids.device):
                raise RuntimeError("GraphedStep captures on the current stream, which must not be the default one: "
                                   "run the loop inside graphed_step.loop_stream")
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(self.input_ids.device)
            # each graph its own memory pool: the tail's output must survive the next micro-batch's capture
            with torch.cuda.graph(graph, stream=stream):
                fn()
            self._graphs[name] = graph
        graph.replay()


class GraphReplayStep(DeviceUpdateStep):
    """The step strategy of train.cuda_graph (steps.py): each micro-batch's forward + backward and the step's update
    replayed from a ``GraphedStep``'s graphs (captured on first use); the one read after the tail, as
    ``DeviceUpdateStep``. The micro-batch graph holds ``steps.forward_backward`` itself: a trainer's override of
    ``forward_backward`` or ``forward_backward_step`` runs in the eager warm-up steps only."""

    def __init__(self, graphed: GraphedStep):
        super().__init__(graphed.model, graphed.optimizer, graphed.clip_grad, graphed.expert_bias_rate)
        self.graphed = graphed

    def forward_backward(self, micro_batches: Iterable[MicroBatch], eager: ForwardBackward | None = None) -> LossTerms:
        self.graphed.begin_step()
        for input_ids, labels in micro_batches:
            self.graphed.run(input_ids, labels)
        return LossTerms(self.graphed.sums)

    def update(self, losses: LossTerms, lr: float) -> StepResult:
        return self.read(self.graphed.finish(lr), lr)
