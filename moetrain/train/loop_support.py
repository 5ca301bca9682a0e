"""What the training loop uses around its steps: the device and dtype it trains in, the Ctrl-C flag, the
profiler window, peak memory, and the notes on checkpoints that its error messages carry."""

from __future__ import annotations

import random
import resource
import signal
import threading
from pathlib import Path

import numpy as np
import torch

from moetrain.config.schema import Config
from moetrain.errors import UserError
from moetrain.train import checkpoint as ckpt
from moetrain.train.optim import DTYPES


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


class StopFlag:
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



def latest_note(out_dir: Path) -> str:
    latest = ckpt.latest_intact(out_dir)
    return f"the latest checkpoint {latest} is intact" if latest else "no checkpoint was saved"


def refuse_non_finite(model_state: dict, optimizer_state: dict, step: int, out_dir: Path) -> None:
    """A checkpoint of NaN/inf weights would become the latest and poison every resume: stop instead."""
    bad = ckpt.non_finite_state(model_state, optimizer_state)
    if bad is not None:
        what = {"model.pt": "weights", "optimizer.pt": "optimizer state"}[bad[0]]
        raise UserError(f"training diverged: the {what} hold non-finite values (NaN or inf) in {bad[1]} at step "
                        f"{step}; not saved; {latest_note(out_dir)}; lower optim.lr or check the data")



class Profiler:
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
