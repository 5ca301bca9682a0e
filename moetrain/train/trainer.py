"""The training loop behind `moetrain train`: the ``Trainer``.

One optimizer step (``Trainer.train_step``) = global_batch_size / (micro_batch_size x dp) micro-batches, each
forward + backward (``forward_backward``, ``forward_backward_step``); then grad norm, clipping, a non-finite
check, the AdamW update and the expert-bias update, run by one of the step strategies of steps.py
(``step_mode`` chooses). The loop (``run``) adds metrics, evaluation, profiling, Ctrl-C handling and (every
checkpoint.interval steps) an atomic checkpoint. Distributed and pipeline trainers subclass ``Trainer`` and
override its parts: ``check_layout``, ``build_model``, ``forward_backward`` (a pipeline schedule runs all of a
step's micro-batches), ``forward_backward_step``, ``evaluate``.
Runs on one device; ``DistributedTrainer`` (distributed_trainer.py) runs under torchrun.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moetrain.config.schema import Config
from moetrain.errors import UserError, format_bytes
from moetrain.train import checkpoint as ckpt
from moetrain.train import fp8_dense, graphed_step, memory_check, resume, run_dir, steps
from moetrain.train.loop_support import (
    Profiler,
    StopFlag,
    check_single_device,
    compute_dtype,
    latest_note,
    peak_memory_gib,
    refuse_non_finite,
    resolve_device,
    seed_everything,
)
from moetrain.train.lr import lr_at
from moetrain.train.metrics import MetricsLog, ProgressDisplay, log_line, summary_table
from moetrain.train.optim import PrecisionAwareAdamW
from moetrain.train.steps import (
    DeviceUpdateStep,
    EagerStep,
    LossTerms,
    MicroBatch,
    StepResult,
    StepStrategy,
)
from moetrain.train.throughput import peak_tflops


@dataclass
class TrainResult:
    out_dir: Path
    records: list[dict] = field(default_factory=list)
    last_step: int = 0
    interrupted: bool = False
    finished: bool = False  # the resumed checkpoint had already reached train.steps


class Trainer:
    """The single-device training loop (see the module doc). ``run()`` trains as configured and returns the
    per-step records; it raises UserError on user mistakes. Set-up happens in ``run``, so a refusal (used
    out_dir, memory that will not fit) costs no allocation."""

    def __init__(self, cfg: Config, *, show_progress: bool | None = None):
        self.cfg = cfg
        self.check_layout()
        fp8_dense.require_torchao(cfg)
        self.device = self.choose_device()
        fp8_dense.require_scaled_mm(cfg, self.device)
        self.dtype = compute_dtype(cfg, self.device)
        self.out_dir = Path(cfg.train.out_dir)
        self.show_progress = sys.stderr.isatty() if show_progress is None else show_progress
        from rich.console import Console

        # Messages before the progress display exists: through rich on a terminal, plain lines otherwise.
        early_console = Console(stderr=True) if self.show_progress else None
        self.say = functools.partial(log_line, console=early_console)
        self.warn = functools.partial(log_line, style="yellow", console=early_console)
        self.is_main = True  # the process that prints, writes metrics and run files (rank 0 of a distributed run)
        self.data_rank = (0, 1)  # (this data-parallel rank, data-parallel size): which share of the data it reads
        self.gpus = 1  # devices the step runs on (tflops_per_gpu divides by it)

    # ---- parts a subclass may override ---------------------------------------------------------------------

    def check_layout(self) -> None:
        """Refuse parallel degrees this trainer does not implement (all > 1 here)."""
        check_single_device(self.cfg)

    def choose_device(self) -> torch.device:
        """The device this process trains on (train.device resolved)."""
        return resolve_device(self.cfg)

    def build_model(self):
        """The model on the device in the compute dtype, with HF weights on a fresh run (``self.start`` has no
        checkpoint to resume), prepared for training (``prepare_model``)."""
        from moetrain.models import build_model

        cfg = self.cfg
        with torch.device(self.device):
            model = build_model(cfg)
        model.to(self.dtype)
        if cfg.model.from_hf and not self.start.candidates:  # initial weights from HF (a resume overwrites them)
            from moetrain.models.hf import load_hf_weights

            load_hf_weights(model, cfg.model.from_hf, progress=self.show_progress)
        self.prepare_model(model)
        return model

    def prepare_model(self, model) -> None:
        """Recompute, the aux-loss gradient scale, FP8 dense linears and compile, as configured: what every trainer
        applies to the model as built, before any sharding wraps it (torchao's swap and compile must see the plain
        modules, FSDP the converted ones)."""
        cfg, t = self.cfg, self.cfg.train
        model.set_recompute(t.recompute, t.recompute_layer_ids)
        model.set_aux_grad_scale(1.0 / cfg.grad_accum_steps)  # the backward runs on loss / micro-batches
        fp8_dense.apply_fp8_dense(model, cfg)
        if t.compile:
            for layer in model.layers.values():
                layer.compile()

    def build_optimizer(self) -> PrecisionAwareAdamW:
        """AdamW over the model's parameters with the configured precision of its state."""
        return PrecisionAwareAdamW(self.model.named_parameters(), self.cfg.optim, self.cfg.precision.master_weights)

    def step_mode(self, step: int) -> StepStrategy:
        """The strategy that runs step ``step`` (steps.py), the one place a step's mode is chosen: graph replays
        under train.cuda_graph from the step after WARMUP_STEPS eager ones, else the eager strategy."""
        if self.graph_mode is not None and step >= self.graph_from_step:
            return self.graph_mode
        return self.eager_mode

    def train_step(self, step: int) -> StepResult:
        """One optimizer step at the scheduled learning rate: zero the gradients and MoE counts, forward + backward
        over the step's micro-batches, then the update (clip, AdamW, expert bias, or a skip where the loss or the
        grad norm is not finite). The step strategy reads the result to the host once."""
        lr = lr_at(step - 1, self.cfg.optim, self.cfg.train.steps)
        self.optimizer.zero_grad()
        self.model.reset_moe_stats()
        mode = self.step_mode(step)
        losses = mode.forward_backward(self.micro_batches(), self.forward_backward)
        # Peak memory of forward + backward alone (the optimizer step may add its own temporaries).
        peak_fwd_bwd = peak_memory_gib(self.device)
        result = mode.update(losses, lr)
        result.tokens = self.tokens_per_step
        result.peak_mem_fwd_bwd_gib = peak_fwd_bwd
        return result

    def forward_backward(self, micro_batches: Iterable[MicroBatch]) -> LossTerms:
        """Forward + backward of each of a step's micro-batches, their gradients accumulating; the mean of their
        loss terms (on the device). A pipeline trainer replaces this whole unit with its schedule."""
        sums = torch.zeros(4, device=self.device)
        for input_ids, labels in micro_batches:
            sums += self.forward_backward_step(input_ids, labels).values / self.accum
        return LossTerms(sums)

    def forward_backward_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> LossTerms:
        """One micro-batch (int64 [micro_batch_size, seq_length], on the CPU or the device): the forward and the
        backward of loss / grad_accum_steps; its loss terms."""
        terms = steps.forward_backward(self.model, input_ids.to(self.device, non_blocking=True),
                                       labels.to(self.device, non_blocking=True), self.accum)
        return LossTerms(terms)

    def micro_batches(self) -> Iterator[MicroBatch]:
        """The step's grad_accum_steps micro-batches (CPU int64 [B, S] pairs). The next one is read ahead when
        the consumer returns for it, i.e. once it has launched the previous one's backward: the host's data work
        runs while the GPU computes."""
        for _ in range(self.accum):
            yield self.batches.take()
            self.batches.fetch_ahead()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean LM loss over train.eval_steps micro-batches of the eval split (same batches each time)."""
        from moetrain.train.data import build_data

        cfg, model = self.cfg, self.model
        data = build_data(cfg, cfg.model.vocab_size, "eval")
        was_training = model.training
        model.eval()
        total = torch.zeros((), device=self.device)
        for _ in range(cfg.train.eval_steps):
            input_ids, labels = data.next_batch(cfg.train.micro_batch_size)
            total += model(input_ids.to(self.device), labels.to(self.device)).lm_loss
        model.train(was_training)
        model.reset_moe_stats()
        return (total / cfg.train.eval_steps).item()

    def save(self, step: int) -> None:
        """An atomic checkpoint of step ``step``; refused (UserError) where the state holds non-finite values."""
        model_state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
        refuse_non_finite(model_state, optimizer_state, step, self.out_dir)
        try:
            saved = ckpt.save_checkpoint(
                self.out_dir, step, model_state=model_state, optimizer_state=optimizer_state,
                trainer_state=self.trainer_state(step), config_yaml=self.config_yaml, run_id=self.start.run_id,
                keep_last=self.cfg.checkpoint.keep_last)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"during the save of checkpoint step_{step}, which was not written; "
                                    f"{latest_note(self.out_dir)}") from None
        self.display.log(f"saved checkpoint {saved.path} ({format_bytes(saved.bytes)} in {saved.seconds:.1f} s)")

    def stop_requested(self, stop: StopFlag) -> bool:
        """Whether to save and stop after this step (a signal asked for it)."""
        return stop.requested

    def trainer_state(self, step: int) -> dict:
        """What a checkpoint keeps besides the weights and optimizer: step, skip count, data position, RNG."""
        return {"step": step, "skipped_in_row": self.skipped_in_row, "data": self.batches.state_dict(),
                "rng": ckpt.rng_state()}

    # ---- the run -------------------------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Train as configured; returns the per-step records. Raises UserError on user mistakes."""
        self.open_run()
        if self.start.finished_at is not None:
            self.say(f"nothing to train: checkpoint {self.start.candidates[0]} is at step {self.start.finished_at} "
                     f"and train.steps = {self.cfg.train.steps}; the run is finished (raise train.steps to train "
                     "further)")
            return TrainResult(out_dir=self.out_dir, last_step=self.start.finished_at, finished=True)
        self._set_up()
        return self._loop()

    def open_run(self) -> None:
        """The out_dir made and checked, the memory projection (``self.projection``) and how the run starts there
        (``self.start``: fresh, resumed, finished)."""
        run_dir.prepare_out_dir(self.out_dir)
        self.projection = memory_check.check(self.cfg, self.device, self.warn)
        self.start = resume.open_run(self.cfg, self.out_dir, self.warn)

    def _set_up(self) -> None:
        """Model, optimizer and data (restored from the resumed checkpoint), the step strategies, the metrics log."""
        from moetrain.config.load import dump_config
        from moetrain.models.accounting import count_params, train_flops_per_token
        from moetrain.train.data import BatchAhead, build_data

        cfg, t = self.cfg, self.cfg.train
        seed_everything(t.seed)
        self.model = self.build_model()
        self.optimizer = self.build_optimizer()
        train_data = build_data(cfg, cfg.model.vocab_size, "train", *self.data_rank)
        self._restore(train_data)
        if self.is_main:
            run_dir.claim(self.out_dir, self.start.run_id, self.resume_from)
        self.accum = cfg.grad_accum_steps
        self.batches = BatchAhead(train_data, t.micro_batch_size)
        self.eager_mode, self.graph_mode = self._step_modes()
        self.graph_from_step = self.start_step + graphed_step.WARMUP_STEPS + 1
        self.tokens_per_step = t.global_batch_size * t.seq_length
        self.flops_per_token = train_flops_per_token(cfg, t.seq_length)
        self.device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_tflops = peak_tflops(self.device_name, cfg.precision.dtype if self.device.type == "cuda" else "fp32")
        self.counts = count_params(cfg)
        self.config_yaml = dump_config(cfg)
        self.metrics = MetricsLog(self.out_dir, self.start_step if self.resume_from is not None else None,
                                  t.tensorboard) if self.is_main else _NoMetrics()
        self.profiler = Profiler(cfg, self.out_dir)
        if t.manual_gc:
            gc.disable()

    def _restore(self, train_data) -> None:
        """Model, optimizer, data position and RNG from the resumed checkpoint, if any; sets start_step,
        skipped_in_row and resume_from (None on a fresh run)."""
        self.start_step, self.skipped_in_row, self.resume_from = 0, 0, None
        if not self.start.candidates:
            return
        self.resume_from, state = resume.load_into(self.start, self.cfg, self.model, self.optimizer, train_data,
                                                   self.cfg.checkpoint.resume != "auto", self.warn)
        self.start_step = int(state["step"])
        self.skipped_in_row = int(state["skipped_in_row"])
        if self.is_main:
            resume.set_aside_later(self.out_dir, self.resume_from, self.warn)

    def _step_modes(self) -> tuple[StepStrategy, StepStrategy | None]:
        """(the eager strategy, the graph strategy or None). Eagerly, where every parameter's update runs on the
        device (the Triton AdamW kernel, any dtypes; torch's fused AdamW, one dtype) clip and skip are inside it
        (no pass over the gradients to scale them, no host sync before the update); where some parameter takes the
        explicit path (mixed-precision state without the kernel) the update is decided on the host."""
        cfg, t, o = self.cfg, self.cfg.train, self.cfg.optim
        bias_rate = cfg.moe.expert_bias_update_rate if cfg.is_moe and cfg.moe.expert_bias else None
        graph_mode = None
        if t.cuda_graph:
            graphed = graphed_step.GraphedStep(self.model, self.optimizer, self.accum, t.micro_batch_size,
                                               t.seq_length, self.device, o.clip_grad, bias_rate)
            graph_mode = graphed_step.GraphReplayStep(graphed)
        eager = EagerStep if self.optimizer.explicit_slots() else DeviceUpdateStep
        return eager(self.model, self.optimizer, o.clip_grad, bias_rate), graph_mode

    def _loop(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        result = TrainResult(out_dir=self.out_dir, last_step=self.start_step)
        last_saved = self.start_step if self.resume_from is not None else None
        try:
            # train.cuda_graph: eager steps, capture and replays on one stream of their own (graphed_step.loop_stream)
            with StopFlag() as stop, ProgressDisplay(t.steps, self.start_step, self.show_progress,
                                                                     quiet=not self.is_main) as self.display, \
                    graphed_step.loop_stream(self.device, self.graph_mode is not None):
                self._log_start()
                for step in range(self.start_step + 1, t.steps + 1):
                    self.profiler.before_step(step)
                    record = self._timed_step(step)
                    self.metrics.write(record)
                    result.records.append(record)
                    result.last_step = step
                    if step % t.log_interval == 0 or step == t.steps:
                        self.display.update(record)
                    self.profiler.after_step(step)
                    if t.manual_gc and step % t.manual_gc_interval == 0:
                        gc.collect()
                    periodic = cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0
                    stopping = self.stop_requested(stop)
                    if periodic or stopping:
                        self.save(step)
                        last_saved = step
                    if stopping:
                        self.display.log(f"interrupted: checkpoint saved at step {step}; resume with "
                                         "checkpoint.resume=auto")
                        result.interrupted = True
                        break
                if not result.interrupted and cfg.checkpoint.save_final and last_saved != result.last_step \
                        and result.last_step > 0:
                    self.save(result.last_step)
        except torch.cuda.OutOfMemoryError as err:
            raise UserError(memory_check.oom_message(self.projection, result.last_step + 1, err)) from None
        except KeyboardInterrupt as err:
            if str(err):  # raised by save() with what was and was not written
                raise
            raise KeyboardInterrupt(f"stopped at once during step {result.last_step + 1} (Ctrl-C twice), without "
                                    f"saving it; {latest_note(self.out_dir)}") from None
        finally:
            # Also on errors (divergence abort, Ctrl-C twice): close files, hand GC back, drop hooks.
            self.metrics.close()
            self.profiler.close()
            self.optimizer.close()
            if t.manual_gc:
                gc.enable()
        if self.is_main and (self.show_progress or result.records):
            from rich.console import Console

            Console(stderr=True).print(summary_table(result.records, f"{cfg.model.name}: training summary"))
        return result

    def _log_start(self) -> None:
        """The run's opening lines: model, device, batch, memory projection, resume and mode notes."""
        cfg, t, o, log = self.cfg, self.cfg.train, self.cfg.optim, self.display.log
        log(f"{cfg.model.name}: {self.counts.total / 1e6:,.2f}M params ({self.counts.active / 1e6:,.2f}M active) on "
            f"{self.device_name or self.device.type}, {str(self.dtype).replace('torch.', '')}; {self.accum} "
            f"micro-batch(es) of {t.micro_batch_size} x {t.seq_length} tokens per step; output in {self.out_dir}")
        log(self.projection.short())
        if o.warmup_steps >= t.steps > self.start_step:
            log(f"optim.warmup_steps = {o.warmup_steps} is not below train.steps = {t.steps}: the whole run is "
                f"warmup (the lr reaches {lr_at(t.steps - 1, o, t.steps):.2e} of its peak {o.lr:.2e}); lower "
                "optim.warmup_steps to train at the peak", style="yellow")
        if self.resume_from is not None:
            log(f"resumed from {self.resume_from} at step {self.start_step}")
        if self.graph_mode is not None:
            log(f"train.cuda_graph: {graphed_step.WARMUP_STEPS} eager steps, then each micro-batch's forward + "
                "backward and each step's update replay from CUDA graphs (captured on the next step)")
        if self.device.type == "cuda" and cfg.is_moe and cfg.moe.backend in ("auto", "triton"):
            log("the first step compiles and tunes the MoE kernels for these shapes (Triton configs, and with "
                "moe.backend=auto each GEMM against torch._grouped_mm, cached on disk): it is slower")

    def _timed_step(self, step: int) -> dict:
        """Step ``step`` timed until the device has finished it, its skip counted, evaluated where due: its
        metrics.jsonl record."""
        t = self.cfg.train
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        result = self.train_step(step)
        self._count_skip(step, result)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        record = self._record(step, result, elapsed)
        if t.eval_interval and step % t.eval_interval == 0:
            record["eval_loss"] = self.evaluate()
            self.display.log(f"step {step}: eval loss {record['eval_loss']:.4f} ({t.eval_steps} micro-batches)")
        return record

    def _count_skip(self, step: int, result: StepResult) -> None:
        """Count consecutive skipped steps; UserError past train.max_skipped_steps (the run diverged)."""
        t = self.cfg.train
        if not result.skipped:
            self.skipped_in_row = 0
            return
        self.skipped_in_row += 1
        self.display.log(f"step {step}: non-finite loss ({result.loss}) or grad norm ({result.grad_norm}); step "
                         f"skipped ({self.skipped_in_row} in a row, limit train.max_skipped_steps = "
                         f"{t.max_skipped_steps})", style="yellow")
        if self.skipped_in_row > t.max_skipped_steps:
            self.metrics.close()
            raise UserError(
                f"training diverged: {self.skipped_in_row} consecutive steps with a non-finite loss or gradient "
                f"(train.max_skipped_steps = {t.max_skipped_steps}); lower optim.lr or check the data")

    def _record(self, step: int, result: StepResult, elapsed: float) -> dict:
        """The metrics.jsonl record of a step that took ``elapsed`` seconds (keys in this order)."""
        tflops = self.flops_per_token * result.tokens / elapsed / 1e12 / self.gpus
        return {
            "step": step, "loss": result.loss, "lm_loss": result.lm_loss, "aux_loss": result.aux_loss,
            "mtp_loss": result.mtp_loss if self.cfg.model.mtp_num_layers else None,
            "lr": result.lr, "grad_norm": result.grad_norm, "tokens_per_s": result.tokens / elapsed,
            "tflops_per_gpu": tflops, "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "peak_mem_gib": peak_memory_gib(self.device), "peak_mem_fwd_bwd_gib": result.peak_mem_fwd_bwd_gib,
            "step_time_s": elapsed, "skipped": result.skipped,
            "load_imbalance": [round(v, 4) for v in result.load_imbalance],
        }


class _NoMetrics:
    """The metrics log of a process that does not write them (a distributed run's ranks but 0)."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def run(cfg: Config, *, show_progress: bool | None = None) -> TrainResult:
    """Train as configured: ``Trainer(cfg).run()``, the JAX backend's trainer with train.backend=jax, or the
    distributed trainer's under torchrun or with parallel degrees above 1 (the pipeline trainer's with
    parallel.pp > 1); returns the per-step records. Raises UserError on
    user mistakes."""
    from moetrain.distributed.launch import wants_distributed

    if cfg.train.backend == "jax":
        from moetrain.jax import require_jax

        require_jax()  # before the JAX modules import jax
        from moetrain.jax.trainer import JaxTrainer

        return JaxTrainer(cfg, show_progress=show_progress).run()
    if wants_distributed(cfg):
        if cfg.parallel.pp > 1:
            from moetrain.train.pipeline_trainer import PipelineTrainer

            return PipelineTrainer(cfg, show_progress=show_progress).run()
        from moetrain.train.distributed_trainer import DistributedTrainer

        return DistributedTrainer(cfg, show_progress=show_progress).run()
    return Trainer(cfg, show_progress=show_progress).run()
