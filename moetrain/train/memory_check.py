"""Will this run fit? `moetrain train` asks the planner before it allocates anything.

The projection is ``moetrain.plan.memory.project_memory`` for the device the run is on: the GPU's
free memory (after the CUDA context exists), or on the CPU the host memory available to this
process (MemAvailable, bounded by a cgroup limit). Out-of-memory configs are refused with the
projection and the changes that would make them fit; at-risk ones are warned about.
``train.skip_memory_check=true`` skips the refusal (the projection is still printed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from moetrain.config.schema import Config
from moetrain.errors import ConfigError, UserError

GiB = 2**30
MAX_SUGGESTIONS = 3


@dataclass
class Projection:
    peak_gib: float  # allocator peak (torch.cuda.max_memory_allocated; RSS growth on the CPU)
    first_step_gib: float  # the first step's, with the MoE kernel tuning (>= peak_gib)
    reserved_gib: float  # with the allocator's fragmentation
    available_gib: float
    verdict: str  # fits | at-risk | out-of-memory
    where: str  # "NVIDIA H200 GPU memory" or "CPU RAM"
    breakdown: str

    def _first(self) -> str:
        if self.first_step_gib <= self.peak_gib + 0.005:
            return ""
        return f", {self.first_step_gib:.2f} GiB on the first step while the MoE kernels are tuned"

    def short(self) -> str:
        return (f"projected peak memory {self.peak_gib:.2f} GiB{self._first()}, of {self.available_gib:.2f} GiB "
                f"available {self.where} ({self.verdict})")

    def summary(self) -> str:
        return (f"projected peak memory {self.peak_gib:.2f} GiB{self._first()} ({self.reserved_gib:.2f} GiB with "
                f"fragmentation) of {self.available_gib:.2f} GiB available {self.where} ({self.breakdown})")


def _cgroup_limit_bytes() -> float | None:
    """Memory this process may still take under its cgroup (v2, then v1), or None."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = float(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or float(limit) >= 2**60:
            return None
        return max(float(limit) - usage, 0.0)
    return None


def host_available_bytes() -> float:
    """MemAvailable from /proc/meminfo, bounded by the cgroup's remaining limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = float(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:  # not Linux: total physical memory as the bound
        import os

        available = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limit = _cgroup_limit_bytes()
    return min(available, limit) if limit is not None else available


def available_bytes(device: torch.device) -> tuple[float, str]:
    """(bytes this run may allocate, where) on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"on {torch.cuda.get_device_name(device)} GPU memory"
    return host_available_bytes(), "in CPU RAM"


def as_trained(cfg: Config, device: torch.device) -> Config:
    """The config as the trainer runs it on ``device`` (CPU runs train in fp32)."""
    if device.type == "cuda":
        return cfg
    return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, dtype="fp32"))


def _report(cfg: Config, available: float, device: torch.device):
    from moetrain.plan.hardware import Hardware
    from moetrain.plan.memory import CONTEXT_GIB, project_memory

    # project_memory leaves CONTEXT_GIB for the CUDA context; the free memory we measured is after it.
    hw = Hardware(name=device.type, peak_tflops={"bf16": 1.0}, hbm_gib=available / GiB + CONTEXT_GIB,
                  hbm_tbps=1.0, gpus_per_node=1, intra_node_gbps=1.0, inter_node_gbps=1.0)
    return project_memory(cfg, hw, device=device.type)


def project(cfg: Config, device: torch.device) -> Projection:
    available, where = available_bytes(device)
    rep = _report(as_trained(cfg, device), available, device)
    pk = rep.peak
    g = lambda x: f"{x / GiB:.2f}"  # noqa: E731
    breakdown = (f"params {g(pk.params)}, gradients {g(pk.grads)}, optimizer {g(pk.optimizer)}, activations "
                 f"{g(pk.activations)}, other {g(pk.other)} GiB at the {pk.phase}")
    return Projection(rep.peak_gib, rep.first_step_gib, rep.reserved_gib, available / GiB, rep.verdict, where,
                      breakdown)


# ---- what would make it fit ----------------------------------------------------------------

def _with(cfg: Config, changes: dict[str, object]) -> Config:
    sections = {}
    for key, value in changes.items():
        section, name = key.split(".")
        current = sections.get(section, getattr(cfg, section))
        sections[section] = dataclasses.replace(current, **{name: value})
    return dataclasses.replace(cfg, **sections)


def _candidates(cfg: Config) -> list[dict[str, object]]:
    """Changes to try, least invasive first (each keeps the model and the tokens per step)."""
    t = cfg.train
    bf16_moments = {"optim.exp_avg_dtype": "bf16", "optim.exp_avg_sq_dtype": "bf16"}
    out = [bf16_moments, BF16_STATE, {"train.recompute": "full"}]
    if t.micro_batch_size > 1:
        out.append({"train.micro_batch_size": max(t.micro_batch_size // 2, 1)})
        out.append({"train.micro_batch_size": 1})
    out.append({**BF16_STATE, "train.recompute": "full"})
    out.append(_strongest(cfg))
    return out


BF16_STATE = {"optim.exp_avg_dtype": "bf16", "optim.exp_avg_sq_dtype": "bf16", "optim.main_grads_dtype": "bf16",
              "precision.master_weights": False}


def _strongest(cfg: Config) -> dict[str, object]:
    """Every memory lever that keeps the model: bf16 state, full recompute, one sequence per micro-batch."""
    return {**BF16_STATE, "train.recompute": "full", "train.micro_batch_size": 1}


def _legal(cfg: Config) -> bool:
    try:
        cfg.check()
    except ConfigError:
        return False
    return True


def _show(changes: dict[str, object]) -> str:
    def value(v):
        return ("true" if v else "false") if isinstance(v, bool) else str(v)

    return " ".join(f"{k}={value(v)}" for k, v in changes.items())


def _changed(cfg: Config, changes: dict[str, object]) -> dict[str, object]:
    """The changes that differ from cfg's values (those already set need no suggesting)."""
    def current(key):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    return {k: v for k, v in changes.items() if current(k) != v}


class _Trials:
    """Projections of changed configs; remembers the smallest peak seen."""

    def __init__(self, cfg: Config, device: torch.device, available: float):
        self.cfg, self.device, self.available = cfg, device, available
        self.smallest: tuple[float, str] | None = None

    def peak_if_fits(self, changes: dict[str, object]) -> float | None:
        changes = _changed(self.cfg, changes)
        trial = _with(self.cfg, changes)
        if not changes or not _legal(trial):
            return None
        rep = _report(as_trained(trial, self.device), self.available, self.device)
        if self.smallest is None or rep.peak_gib < self.smallest[0]:
            self.smallest = (rep.peak_gib, _show(changes))
        return rep.peak_gib if rep.verdict != "out-of-memory" else None

    def largest_fitting(self, key: str, below: int, base: dict[str, object]) -> int | None:
        """The largest value of integer ``key`` under ``below`` that fits on top of ``base`` (bisection)."""
        lo, hi, best = 1, below - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.peak_if_fits({**base, key: mid}) is not None:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best


def suggestions(cfg: Config, device: torch.device, available: float) -> tuple[list[str], str | None]:
    """(up to MAX_SUGGESTIONS changes projected to fit, as key=value overrides with their peaks;
    the smallest projection seen when none fits)."""
    trials, out = _Trials(cfg, device, available), []

    def offer(changes: dict[str, object]) -> None:
        changes = _changed(cfg, changes)
        text = _show(changes)
        if changes and all(not line.startswith(text + " (") for line in out):
            peak = trials.peak_if_fits(changes)
            if peak is not None:
                out.append(f"{text} ({peak:.2f} GiB)")

    for changes in _candidates(cfg):
        if len(out) < MAX_SUGGESTIONS - 1:
            offer(changes)
    for base in ({}, BF16_STATE, _strongest(cfg)):  # a smaller model (no MTP, fewer layers) alone or with other levers
        before = len(out)
        if cfg.model.mtp_num_layers:
            offer({**base, "model.mtp_num_layers": 0})
        layers = trials.largest_fitting("model.num_layers", cfg.model.num_layers, base)
        if layers is not None:
            offer({**base, "model.num_layers": layers})
        if len(out) > before:
            break
    if not out:  # shorter sequences change the data: offered only when nothing else fits
        seq = trials.largest_fitting("train.seq_length", cfg.train.seq_length, _strongest(cfg))
        if seq is not None:
            offer({**_strongest(cfg), "train.seq_length": seq})
    smallest = None if out or trials.smallest is None else f"{trials.smallest[0]:.2f} GiB with {trials.smallest[1]}"
    return out[:MAX_SUGGESTIONS], smallest


def check(cfg: Config, device: torch.device, log) -> Projection:
    """Project this run's peak memory on ``device``; refuse (UserError) when it will not fit."""
    proj = project(cfg, device)
    if proj.verdict == "out-of-memory":
        if cfg.train.skip_memory_check:
            log(f"warning: {proj.summary()}: it will not fit (train.skip_memory_check=true: trying anyway)")
            return proj
        fixes, smallest = suggestions(cfg, device, proj.available_gib * GiB)
        fix_text = ("; changes projected to fit: " + "; ".join(fixes)) if fixes else \
            (f"; none of the changes tried fits (the smallest projection: {smallest})" if smallest else
             "; none of the changes tried fits")
        raise UserError(f"{proj.summary()}: this run will not fit{fix_text}; or train.skip_memory_check=true to "
                        "try anyway")
    if proj.verdict == "at-risk":
        log(f"warning: {proj.summary()}: at risk of running out of memory")
    return proj


def oom_message(proj: Projection | None, step: int, err: Exception) -> str:
    """One line for a CUDA out-of-memory error that the projection did not prevent."""
    first = str(err).splitlines()[0] if str(err) else "out of memory"
    first = first.split(". GPU")[0]
    beside = f"; {proj.summary()}" if proj is not None else ""
    return (f"CUDA out of memory at step {step} ({first}){beside}; lower train.micro_batch_size, turn on "
            "train.recompute=full or keep the optimizer state in bf16 (optim.exp_avg_dtype=bf16 "
            "optim.exp_avg_sq_dtype=bf16)")
