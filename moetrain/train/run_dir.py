"""A training out_dir belongs to one run lineage: a fresh run and the runs that resume it.

``<out_dir>/run.json`` names the lineage (``run_id``); every checkpoint's meta.json carries it
too. A fresh run refuses an out_dir that holds another run's metrics or checkpoints, unless
``train.overwrite`` asks to start over: then the old run's files move to
``<out_dir>/replaced/<time>-<run id>/``, never deleted. A resume that goes back to an earlier
checkpoint moves the checkpoints after it there as well (they belong to the abandoned future),
with a copy of metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from moetrain.errors import UserError, os_error
from moetrain.train import checkpoint as ckpt

RUN_FILE = "run.json"
REPLACED_DIR = "replaced"
METRICS_FILE = "metrics.jsonl"
# What a run writes into out_dir besides checkpoints/ (moved aside with it by train.overwrite).
RUN_ARTIFACTS = (RUN_FILE, METRICS_FILE, "tensorboard", "profile")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def prepare_out_dir(out_dir: Path) -> None:
    """Create out_dir and prove it is writable, or raise a one-line UserError saying why not."""
    key = f"train.out_dir = {out_dir}"
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{key}: exists and is not a directory; pass a directory path")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise os_error(err, f"{key}: cannot write there") from None


@dataclass
class RunContents:
    """What an out_dir holds of earlier runs."""

    out_dir: Path
    run_id: str | None = None  # from run.json, else the one run id the checkpoints carry
    checkpoints: list[Path] = field(default_factory=list)
    metrics_steps: int = 0

    @property
    def holds_run(self) -> bool:
        """Metrics or checkpoints to protect (a run.json alone is a run that stopped before its first step)."""
        return bool(self.checkpoints or self.metrics_steps)

    def describe(self) -> str:
        parts = []
        if self.run_id:
            parts.append(f"run id {self.run_id}")
        if self.metrics_steps:
            parts.append(f"{METRICS_FILE} with {self.metrics_steps} steps")
        if self.checkpoints:
            parts.append(f"{len(self.checkpoints)} checkpoint(s), the last {self.checkpoints[-1].name}")
        return ", ".join(parts)


def scan(out_dir: Path) -> RunContents:
    found = RunContents(out_dir, checkpoints=ckpt.list_checkpoints(out_dir))
    metrics = out_dir / METRICS_FILE
    if metrics.is_file():
        with open(metrics, "rb") as f:
            found.metrics_steps = sum(1 for line in f if line.strip())
    found.run_id = read_run_id(out_dir)
    if found.run_id is None:
        ids = {ckpt.read_meta(p).get("run_id") for p in found.checkpoints} - {None}
        found.run_id = ids.pop() if len(ids) == 1 else None
    return found


def read_run_id(out_dir: Path) -> str | None:
    try:
        data = json.loads((out_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data.get("run_id") if isinstance(data, dict) else None


def claim(out_dir: Path, run_id: str, resumed_from: Path | None) -> None:
    """Write run.json for lineage ``run_id`` (atomically; kept as it is when it already says so)."""
    if read_run_id(out_dir) == run_id:
        return
    data = {"run_id": run_id, "created_at": time.time(),
            "resumed_from": str(resumed_from) if resumed_from is not None else None}
    tmp = out_dir / f".{RUN_FILE}.partial"
    try:
        tmp.write_text(json.dumps(data) + "\n")
        os.replace(tmp, out_dir / RUN_FILE)
    except OSError as err:
        raise os_error(err, f"writing {out_dir / RUN_FILE}") from None


def move_aside(out_dir: Path, paths: list[Path], copies: list[Path] = (), label: str = "") -> Path:
    """Move ``paths`` (and copy ``copies``) under out_dir/replaced/<time>-<label>/, keeping their
    places relative to out_dir; returns that directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = out_dir / REPLACED_DIR / (f"{stamp}-{label}" if label else stamp)
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('~')[0]}~{n}")
    try:
        for path in copies:
            target = dest / path.relative_to(out_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        for path in paths:
            target = dest / path.relative_to(out_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, target)
    except OSError as err:
        raise os_error(err, f"moving the earlier run's files to {dest}") from None
    return dest


def move_run_aside(contents: RunContents) -> Path:
    """Move every file and directory of the run in contents.out_dir (checkpoints/ included) aside."""
    d = contents.out_dir
    present = [d / n for n in (*RUN_ARTIFACTS, "checkpoints") if (d / n).exists()]
    return move_aside(d, present, label=contents.run_id or "")


def refuse_fresh_run(contents: RunContents) -> UserError:
    d = contents.out_dir
    return UserError(
        f"train.out_dir = {d} already holds a run ({contents.describe()}); continue it with "
        f"checkpoint.resume=auto, start over with train.overwrite=true (moves it to {d / REPLACED_DIR}/), "
        "or pass a new train.out_dir")
