"""``train.cuda_graph``: each micro-batch's forward + backward replayed from one CUDA graph.

Why: a step whose kernels are short waits on the host. The tiny preset's step on an H200 is ~1,500 eager
launches, each waiting on Python (52-72 ms a step on the hosts we were lent, a few ms of GPU work), and an
MoE layer launches ~30 kernels, some of them short. A replay launches the whole forward + backward at once.

What is captured (on the step after ``WARMUP_STEPS`` eager ones, which autotune the Triton kernels, let
moe.backend=auto time its choices and settle the allocator): ``model(input_ids, labels)``, the backward
of ``loss / accum``, and the step's loss terms gathered into one static fp32 [4] tensor (loss, lm, aux, mtp).
The inputs are static [B, S] int64 buffers on the device that each micro-batch is copied into. Eager as
before: zero_grad, the grad norm, the one host sync for metrics, clipping, the optimizer step, the
expert-bias update, evaluation. Parameters and the MoE counts are updated in place, so replays see them.

Gradients: where a parameter has a separate main-grad buffer (optim.main_grads_dtype differs from its
dtype) the hook captured with the backward adds each replay's gradient into it, so micro-batches
accumulate as in eager mode. A parameter without one gets its gradient written (not added) by each
replay, into the buffer the capture allocated; the step hands that buffer back as ``param.grad``, and
with such parameters a step may hold only one micro-batch.

Capturing does not run the work: the capture step replays right after capturing. A host sync, a
host read of routing-dependent values or a CPU tensor inside the forward fails the capture loudly.
Shapes: [micro_batch_size, seq_length] are fixed for a run; the graph is captured once.
"""

from __future__ import annotations

import torch

from moetrain.errors import UserError

WARMUP_STEPS = 2


def forward_backward(model, input_ids: torch.Tensor, labels: torch.Tensor, accum: int) -> torch.Tensor:
    """One micro-batch as the trainer runs it, eagerly or inside the graph: the forward, the backward of
    loss / accum; returns the loss terms [4] fp32 (loss, lm_loss, aux_loss, mtp_loss; 0 without MTP)."""
    out = model(input_ids, labels)
    (out.loss / accum).backward()
    mtp = out.mtp_loss if out.mtp_loss is not None else torch.zeros((), device=input_ids.device)
    # detached: a tensor with a grad_fn would keep the micro-batch's autograd graph (its nodes) alive
    return torch.stack([out.loss.float(), out.lm_loss, out.aux_loss, mtp]).detach()


def on_side_stream(fn, device: torch.device):
    """``fn()`` on a fresh CUDA stream, ordered after the current stream's work and before what follows;
    returns its result. Warm-ups before a capture run there: torch's CUDA-graph notes ask for it (state
    that libraries create lazily per stream, such as cuBLAS workspaces, must exist before capture)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        result = fn()
    torch.cuda.current_stream(device).wait_stream(side)
    return result


class GraphedStep:
    """Forward + backward of one micro-batch as a CUDA graph (see the module doc)."""

    def __init__(self, model, params: list[torch.nn.Parameter], has_main_grad: list[bool], accum: int,
                 micro_batch_size: int, seq_length: int, device: torch.device, reset):
        plain = [p for p, main in zip(params, has_main_grad) if not main]
        if plain and accum > 1:
            raise UserError(
                f"train.cuda_graph with {accum} micro-batches per step needs separate main grads for every parameter "
                f"({len(plain)} have none: optim.main_grads_dtype equals their dtype), since a replay writes "
                "their gradients rather than adding to them; use one micro-batch per step "
                "(train.global_batch_size = micro_batch_size x dp) or fp32 main grads")
        if device.type != "cuda":
            raise UserError(f"train.cuda_graph needs a CUDA device (training runs on {device}); "
                            "set train.cuda_graph=false")
        self.model, self.accum, self.reset = model, accum, reset
        self._plain = plain
        self._plain_grads: list[torch.Tensor | None] = []
        self.input_ids = torch.zeros(micro_batch_size, seq_length, dtype=torch.int64, device=device)
        self.labels = torch.zeros_like(self.input_ids)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.terms: torch.Tensor | None = None  # [4] fp32: loss, lm_loss, aux_loss, mtp_loss of the last replay

    def _forward_backward(self) -> torch.Tensor:
        return forward_backward(self.model, self.input_ids, self.labels, self.accum)

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Copy the micro-batch (CPU or device [B, S] int64) into the static inputs, capture on the first
        call (which must be a step's first micro-batch: capturing calls ``reset``), replay; returns the loss
        terms [4] fp32 (a static tensor: use before the next call)."""
        if tuple(input_ids.shape) != tuple(self.input_ids.shape):
            raise ValueError(f"micro-batch {tuple(input_ids.shape)} differs from the captured "
                             f"{tuple(self.input_ids.shape)}")
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        for p, g in zip(self._plain, self._plain_grads):
            p.grad = g
        return self.terms

    def _capture(self) -> None:
        # One eager pass off the capture first (``on_side_stream``). It accumulates gradients and MoE counts
        # like a real micro-batch, so ``reset`` (zero_grad + MoE stats) undoes it.
        on_side_stream(self._forward_backward, self.input_ids.device)
        self.reset()
        for p in self._plain:
            p.grad = None  # the capture's backward allocates them in the graph's memory
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.input_ids.device)
        with torch.cuda.graph(graph):
            self.terms = self._forward_backward()
        self._plain_grads = [p.grad for p in self._plain]
        self.graph = graph
