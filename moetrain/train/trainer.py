"""The training loop behind `moetrain train`.

One optimizer step = global_batch_size / (micro_batch_size x dp) micro-batches, each
forward + backward; then grad norm, clipping, a non-finite check, the AdamW update, the
expert-bias update, metrics, and (every checkpoint.interval steps) an atomic checkpoint.
Runs on one device; parallel degrees > 1 belong to the distributed trainer (not built yet)
and are refused with a clear message rather than ignored.
"""

from __future__ import annotations

import functools
import gc
import math
import random
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moetrain.config.schema import Config
from moetrain.errors import UserError, format_bytes
from moetrain.train import checkpoint as ckpt
from moetrain.train import memory_check, resume, run_dir
from moetrain.train.lr import lr_at
from moetrain.train.metrics import MetricsLog, ProgressDisplay, log_line, summary_table
from moetrain.train.optim import DTYPES, PrecisionAwareAdamW
from moetrain.train.throughput import peak_tflops


@dataclass
class TrainResult:
    out_dir: Path
    records: list[dict] = field(default_factory=list)
    last_step: int = 0
    interrupted: bool = False
    finished: bool = False  # the resumed checkpoint had already reached train.steps


class _StopFlag:
    """SIGINT/SIGTERM ask the loop to stop after the current step (and save); a second SIGINT
    interrupts at once."""

    def __init__(self):
        self.requested = False
        self.raised = False
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            if self.raised:  # already stopping at once: let the cleanup finish
                return
            self.raised = True
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device = cuda but no CUDA device is available; use train.device=auto or cpu")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """bf16/fp16 parameters on GPU as configured; CPU training always runs in fp32."""
    return DTYPES[cfg.precision.dtype] if device.type == "cuda" else torch.float32


def check_single_device(cfg: Config) -> None:
    p = cfg.parallel
    multi = {k: getattr(p, k) for k in ("dp", "tp", "pp", "vpp", "cp", "ep", "etp") if getattr(p, k) > 1}
    if multi:
        listed = ", ".join(f"parallel.{k} = {v}" for k, v in multi.items())
        raise UserError(
            f"{listed}: moetrain train runs on a single device for now (the distributed trainer is not "
            "built yet); set these to 1 to train, or use `moetrain plan` to project the layout")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # Peak resident set size of the process (KiB on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run(cfg: Config, *, show_progress: bool | None = None) -> TrainResult:
    """Train as configured; returns the per-step records. Raises UserError on user mistakes."""
    from rich.console import Console

    from moetrain.config.load import dump_config
    from moetrain.models import build_model
    from moetrain.models.accounting import count_params, train_flops_per_token
    from moetrain.train.data import BatchAhead, build_data
    from moetrain.train.graphed_step import WARMUP_STEPS as GRAPH_WARMUP_STEPS
    from moetrain.train.graphed_step import GraphedStep, device_update, forward_backward, loop_stream

    check_single_device(cfg)
    device = resolve_device(cfg)
    dtype = compute_dtype(cfg, device)
    t, o = cfg.train, cfg.optim
    out_dir = Path(t.out_dir)
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    # Messages before the progress display exists: through rich on a terminal, plain lines otherwise.
    early_console = Console(stderr=True) if show_progress else None
    say = functools.partial(log_line, console=early_console)
    warn = functools.partial(log_line, style="yellow", console=early_console)
    run_dir.prepare_out_dir(out_dir)
    projection = memory_check.check(cfg, device, warn)
    start = resume.open_run(cfg, out_dir, warn)
    if start.finished_at is not None:
        say(f"nothing to train: checkpoint {start.candidates[0]} is at step {start.finished_at} and train.steps = "
            f"{t.steps}; the run is finished (raise train.steps to train further)")
        return TrainResult(out_dir=out_dir, last_step=start.finished_at, finished=True)

    seed_everything(t.seed)
    with torch.device(device):
        model = build_model(cfg)
    model.to(dtype)
    if cfg.model.from_hf and not start.candidates:  # initial weights from HF (a resume overwrites them)
        from moetrain.models.hf import load_hf_weights

        load_hf_weights(model, cfg.model.from_hf, progress=show_progress)
    model.set_recompute(t.recompute, t.recompute_layer_ids)
    if t.compile:
        for layer in model.layers:
            layer.compile()
    optimizer = PrecisionAwareAdamW(model.named_parameters(), o, cfg.precision.master_weights)
    vocab = cfg.model.vocab_size
    train_data = build_data(cfg, vocab, "train")

    start_step, skipped_in_row, resume_from = 0, 0, None
    if start.candidates:
        resume_from, trainer_state = resume.load_into(start, cfg, model, optimizer, train_data,
                                                      cfg.checkpoint.resume != "auto", warn)
        start_step = int(trainer_state["step"])
        skipped_in_row = int(trainer_state["skipped_in_row"])
        resume.set_aside_later(out_dir, resume_from, warn)
    run_dir.claim(out_dir, start.run_id, resume_from)

    accum = cfg.grad_accum_steps
    batches = BatchAhead(train_data, t.micro_batch_size)
    graphed = None
    bias_rate = cfg.moe.expert_bias_update_rate if cfg.is_moe and cfg.moe.expert_bias else None
    if t.cuda_graph:
        graphed = GraphedStep(model, optimizer, accum, t.micro_batch_size, t.seq_length, device, o.clip_grad,
                              bias_rate)
    # Where every parameter takes torch's fused AdamW, the eager step clips and skips inside it too (no pass over
    # the gradients to scale them, no host sync before the update); mixed-precision state keeps the explicit path.
    on_device_update = not optimizer.explicit_slots()
    graph_from_step = start_step + GRAPH_WARMUP_STEPS + 1
    tokens_per_step = t.global_batch_size * t.seq_length
    flops_per_token = train_flops_per_token(cfg, t.seq_length)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_tflops(device_name, cfg.precision.dtype if device.type == "cuda" else "fp32")
    counts = count_params(cfg)
    config_yaml = dump_config(cfg)
    result = TrainResult(out_dir=out_dir, last_step=start_step)
    metrics = MetricsLog(out_dir, start_step if resume_from is not None else None, t.tensorboard)
    profiler = _Profiler(cfg, out_dir)
    if t.manual_gc:
        gc.disable()

    def save(step: int) -> None:
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
        _refuse_non_finite(model_state, optimizer_state, step, out_dir)
        try:
            saved = ckpt.save_checkpoint(
                out_dir, step, model_state=model_state, optimizer_state=optimizer_state,
                trainer_state={"step": step, "skipped_in_row": skipped_in_row,
                               "data": batches.state_dict(), "rng": ckpt.rng_state()},
                config_yaml=config_yaml, run_id=start.run_id, keep_last=cfg.checkpoint.keep_last)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"during the save of checkpoint step_{step}, which was not written; "
                                    f"{_latest_note(out_dir)}") from None
        display.log(f"saved checkpoint {saved.path} ({format_bytes(saved.bytes)} in {saved.seconds:.1f} s)")

    last_saved = start_step if resume_from is not None else None
    try:
        # train.cuda_graph: eager steps, capture and replays on one stream of their own (graphed_step.loop_stream)
        with _StopFlag() as stop, ProgressDisplay(t.steps, start_step, show_progress) as display, \
                loop_stream(device, graphed is not None):
            display.log(
                f"{cfg.model.name}: {counts.total / 1e6:,.2f}M params ({counts.active / 1e6:,.2f}M active) on "
                f"{device_name or device.type}, {str(dtype).replace('torch.', '')}; {accum} micro-batch(es) of "
                f"{t.micro_batch_size} x {t.seq_length} tokens per step; output in {out_dir}")
            display.log(projection.short())
            if o.warmup_steps >= t.steps > start_step:
                display.log(f"optim.warmup_steps = {o.warmup_steps} is not below train.steps = {t.steps}: the whole "
                            f"run is warmup (the lr reaches {lr_at(t.steps - 1, o, t.steps):.2e} of its peak "
                            f"{o.lr:.2e}); lower optim.warmup_steps to train at the peak", style="yellow")
            if resume_from is not None:
                display.log(f"resumed from {resume_from} at step {start_step}")
            if graphed is not None:
                display.log(f"train.cuda_graph: {GRAPH_WARMUP_STEPS} eager steps, then each micro-batch's forward + "
                            "backward and each step's update replay from CUDA graphs (captured on the next step)")
            if device.type == "cuda" and cfg.is_moe and cfg.moe.backend in ("auto", "triton"):
                display.log("the first step compiles and tunes the MoE kernels for these shapes (Triton configs, and "
                            "with moe.backend=auto each GEMM against torch._grouped_mm, cached on disk): it is slower")
            for step in range(start_step + 1, t.steps + 1):
                profiler.before_step(step)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                started = time.perf_counter()
                lr = lr_at(step - 1, o, t.steps)
                optimizer.zero_grad()
                model.reset_moe_stats()
                on_graph = graphed is not None and step >= graph_from_step
                if on_graph:  # forward, backward and the update replayed (graphs captured on first use)
                    graphed.begin_step()
                    for _ in range(accum):
                        graphed.run(*batches.take())
                        batches.fetch_ahead()  # host data work while the GPU runs this backward
                    peak_fwd_bwd = peak_memory_gib(device)
                    # One host sync per step for everything we log; the update has been applied (or skipped).
                    host = graphed.finish(lr).tolist()
                    finite = host[5] == 0.0
                    host = host[:5] + host[6:]  # loss terms, norm, imbalance per MoE layer
                else:
                    sums = torch.zeros(4, device=device)  # loss, lm_loss, aux_loss, mtp_loss
                    for _ in range(accum):
                        input_ids, labels = batches.take()
                        terms = forward_backward(model, input_ids.to(device, non_blocking=True),
                                                 labels.to(device, non_blocking=True), accum)
                        batches.fetch_ahead()  # host data work while the GPU runs this backward
                        sums += terms / accum
                    # Peak memory of forward + backward alone (the optimizer step may add its own temporaries).
                    peak_fwd_bwd = peak_memory_gib(device)
                    if on_device_update:  # clip and skip inside the fused AdamW, then one host sync
                        host = device_update(model, optimizer, sums, lr, o.clip_grad, bias_rate).tolist()
                        finite = host[5] == 0.0
                        host = host[:5] + host[6:]
                    else:
                        grad_norm = optimizer.grad_norm()
                        imbalance = model.load_imbalance()
                        # One host sync per step for everything we log.
                        host = torch.cat([sums, grad_norm.reshape(1).to(device)]
                                         + ([imbalance.float()] if imbalance is not None else [])).tolist()
                        finite = math.isfinite(host[0]) and math.isfinite(host[4])
                loss, lm_loss, aux_loss, mtp_loss, norm = host[:5]
                if finite:
                    skipped_in_row = 0
                    if on_graph or on_device_update:
                        optimizer.count_step()
                    else:
                        if o.clip_grad > 0 and norm > o.clip_grad:
                            optimizer.scale_grads(o.clip_grad / (norm + 1e-6))
                        optimizer.step(lr)
                        if cfg.moe.expert_bias:
                            model.update_expert_bias(cfg.moe.expert_bias_update_rate)
                else:
                    skipped_in_row += 1
                    display.log(f"step {step}: non-finite loss ({loss}) or grad norm ({norm}); step skipped "
                                f"({skipped_in_row} in a row, limit train.max_skipped_steps = {t.max_skipped_steps})",
                                style="yellow")
                    if skipped_in_row > t.max_skipped_steps:
                        metrics.close()
                        raise UserError(
                            f"training diverged: {skipped_in_row} consecutive steps with a non-finite loss or "
                            f"gradient (train.max_skipped_steps = {t.max_skipped_steps}); lower optim.lr or check the data")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - started
                tflops = flops_per_token * tokens_per_step / elapsed / 1e12
                record = {
                    "step": step, "loss": loss, "lm_loss": lm_loss, "aux_loss": aux_loss,
                    "mtp_loss": mtp_loss if cfg.model.mtp_num_layers else None,
                    "lr": lr, "grad_norm": norm, "tokens_per_s": tokens_per_step / elapsed,
                    "tflops_per_gpu": tflops, "mfu": tflops / peak if peak else None,
                    "peak_mem_gib": peak_memory_gib(device), "peak_mem_fwd_bwd_gib": peak_fwd_bwd,
                    "step_time_s": elapsed, "skipped": not finite,
                    "load_imbalance": [round(v, 4) for v in host[5:]],
                }
                if t.eval_interval and step % t.eval_interval == 0:
                    record["eval_loss"] = evaluate(model, cfg, device, build_data)
                    display.log(f"step {step}: eval loss {record['eval_loss']:.4f} ({t.eval_steps} micro-batches)")
                metrics.write(record)
                result.records.append(record)
                result.last_step = step
                if step % t.log_interval == 0 or step == t.steps:
                    display.update(record)
                profiler.after_step(step)
                if t.manual_gc and step % t.manual_gc_interval == 0:
                    gc.collect()
                periodic = cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0
                if periodic or stop.requested:
                    save(step)
                    last_saved = step
                if stop.requested:
                    display.log(f"interrupted: checkpoint saved at step {step}; resume with checkpoint.resume=auto")
                    result.interrupted = True
                    break
            if not result.interrupted and cfg.checkpoint.save_final and last_saved != result.last_step \
                    and result.last_step > 0:
                save(result.last_step)
    except torch.cuda.OutOfMemoryError as err:
        raise UserError(memory_check.oom_message(projection, result.last_step + 1, err)) from None
    except KeyboardInterrupt as err:
        if str(err):  # raised by save() with what was and was not written
            raise
        raise KeyboardInterrupt(f"stopped at once during step {result.last_step + 1} (Ctrl-C twice), without "
                                f"saving it; {_latest_note(out_dir)}") from None
    finally:
        # Also on errors (divergence abort, Ctrl-C twice): close files, hand GC back, drop hooks.
        metrics.close()
        profiler.close()
        optimizer.close()
        if t.manual_gc:
            gc.enable()
    if show_progress or result.records:
        Console(stderr=True).print(summary_table(result.records, f"{cfg.model.name}: training summary"))
    return result


def _latest_note(out_dir: Path) -> str:
    latest = ckpt.latest_intact(out_dir)
    return f"the latest checkpoint {latest} is intact" if latest else "no checkpoint was saved"


def _refuse_non_finite(model_state: dict, optimizer_state: dict, step: int, out_dir: Path) -> None:
    """A checkpoint of NaN/inf weights would become the latest and poison every resume: stop instead."""
    bad = ckpt.non_finite_state(model_state, optimizer_state)
    if bad is not None:
        what = {"model.pt": "weights", "optimizer.pt": "optimizer state"}[bad[0]]
        raise UserError(f"training diverged: the {what} hold non-finite values (NaN or inf) in {bad[1]} at step "
                        f"{step}; not saved; {_latest_note(out_dir)}; lower optim.lr or check the data")


@torch.no_grad()
def evaluate(model, cfg: Config, device: torch.device, build_data) -> float:
    """Mean LM loss over train.eval_steps micro-batches of the eval split (same batches each time)."""
    data = build_data(cfg, cfg.model.vocab_size, "eval")
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for _ in range(cfg.train.eval_steps):
        input_ids, labels = data.next_batch(cfg.train.micro_batch_size)
        total += model(input_ids.to(device), labels.to(device)).lm_loss
    model.train(was_training)
    model.reset_moe_stats()
    return (total / cfg.train.eval_steps).item()


class _Profiler:
    """torch.profiler over steps profile.start_step..profile.end_step; writes a Chrome trace."""

    def __init__(self, cfg: Config, out_dir: Path):
        self.cfg = cfg.profile
        self.path = out_dir / "profile"
        self.active = None

    def before_step(self, step: int) -> None:
        if self.cfg.enabled and step == self.cfg.start_step:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self.active = profile(activities=activities, record_shapes=True)
            self.active.__enter__()

    def after_step(self, step: int) -> None:
        if self.active is not None and step == self.cfg.end_step:
            self.close()

    def close(self) -> None:
        if self.active is None:
            return
        self.active.__exit__(None, None, None)
        self.path.mkdir(parents=True, exist_ok=True)
        trace = self.path / f"trace_steps_{self.cfg.start_step}-{self.cfg.end_step}.json"
        self.active.export_chrome_trace(str(trace))
        self.active = None
