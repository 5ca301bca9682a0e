"""Checkpoints under <out_dir>/checkpoints/step_<N>/, written atomically.

A checkpoint is written into a sibling temporary directory and renamed into place only when
every file is on disk; ``meta.json`` is written last inside it. A crash or kill mid-save
therefore leaves at most a ``*.partial`` directory, which loading ignores and the next save
removes. Contents: model.pt (parameters and buffers), optimizer.pt, trainer.pt (step,
scheduler, data position, RNG states), config.yaml (the resolved config), meta.json.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from moetrain.errors import UserError

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_file(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(out_dir: str | Path, step: int, *, model_state: dict, optimizer_state: dict,
                    trainer_state: dict, config_yaml: str, keep_last: int = 0) -> Path:
    """Write step_<step> atomically and prune old checkpoints beyond ``keep_last`` (0 keeps all)."""
    root = checkpoint_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.partial"
    tmp.mkdir()
    _save_file(model_state, tmp / "model.pt")
    _save_file(optimizer_state, tmp / "optimizer.pt")
    _save_file(trainer_state, tmp / "trainer.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    meta = {"format_version": FORMAT_VERSION, "step": step, "saved_at": time.time()}
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # re-saving the same step (e.g. interrupt right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    if keep_last > 0:
        for old in list_checkpoints(out_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those with meta.json), oldest first."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / "meta.json").is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def resolve_resume(resume: str | None, out_dir: str | Path) -> Path | None:
    """checkpoint.resume -> the directory to load, or None to start fresh.

    'auto' takes the latest complete checkpoint under out_dir and starts fresh when there is
    none; an explicit path must be a complete checkpoint.
    """
    if resume is None:
        return None
    if resume == "auto":
        found = list_checkpoints(out_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "meta.json").is_file():
        raise UserError(f"checkpoint.resume = {resume}: not a complete checkpoint directory (no meta.json)")
    return path


def load_checkpoint(path: Path, device: torch.device) -> dict:
    """Read a checkpoint written by save_checkpoint; tensors land on ``device``."""
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: checkpoint format {meta.get('format_version')} is not {FORMAT_VERSION}")
    try:
        return {
            "meta": meta,
            "model": torch.load(path / "model.pt", map_location=device, weights_only=True),
            "optimizer": torch.load(path / "optimizer.pt", map_location=device, weights_only=True),
            # trainer.pt holds python/numpy RNG states (tuples, numpy arrays): not weights-only.
            "trainer": torch.load(path / "trainer.pt", map_location="cpu", weights_only=False),
        }
    except (OSError, RuntimeError, EOFError) as err:
        raise UserError(f"{path}: cannot read checkpoint ({err})") from err
