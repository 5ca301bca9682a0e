"""How a run starts in its out_dir: fresh, resumed, refused, or already finished.

``open_run`` decides before anything is allocated (run_dir.py says who owns an out_dir);
``load_into`` then restores the model, optimizer, data position and RNG from the chosen
checkpoint, falling back to an older one under ``resume=auto`` when the newest turns out to hold
non-finite values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml

from moetrain.config.schema import Config
from moetrain.errors import UserError
from moetrain.models.legacy import apply_plan, legacy_mlp_plan
from moetrain.train import checkpoint as ckpt
from moetrain.train import run_dir


@dataclass
class RunStart:
    run_id: str
    candidates: list[Path] = field(default_factory=list)  # intact checkpoints to resume from, newest first
    skipped: list[Path] = field(default_factory=list)  # damaged checkpoints passed over
    finished_at: int | None = None  # the checkpoint's step when train.steps is already reached


def open_run(cfg: Config, out_dir: Path, log: Callable[[str], None]) -> RunStart:
    """Decide how this run uses out_dir; moves an earlier run aside only where asked (train.overwrite) or
    where ``resume=auto`` finds nothing intact to continue."""
    contents = run_dir.scan(out_dir)
    resume = cfg.checkpoint.resume
    if resume is None:
        if contents.holds_run:
            if not cfg.train.overwrite:
                raise run_dir.refuse_fresh_run(contents)
            moved = run_dir.move_run_aside(contents)
            log(f"train.overwrite: moved the earlier run ({contents.describe()}) to {moved}")
        return RunStart(run_dir.new_run_id())
    candidates, skipped = ckpt.resume_candidates(resume, out_dir, log)
    if not candidates:
        if contents.holds_run:
            moved = run_dir.move_run_aside(contents)
            log(f"checkpoint.resume = auto: no intact checkpoint in {out_dir}; starting fresh (the earlier run's "
                f"files moved to {moved})")
        return RunStart(run_dir.new_run_id())
    meta = ckpt.read_meta(candidates[0])
    theirs = meta.get("run_id")
    if contents.holds_run and contents.run_id and theirs and contents.run_id != theirs:
        raise UserError(
            f"checkpoint.resume = {resume}: that checkpoint belongs to run {theirs}, but train.out_dir = {out_dir} "
            f"holds run {contents.run_id} ({contents.describe()}); resuming there would mix the two: pass a new "
            "train.out_dir")
    start = RunStart(theirs or contents.run_id or run_dir.new_run_id(), candidates, skipped)
    if meta.get("step", 0) >= cfg.train.steps:
        start.finished_at = meta["step"]
    return start


def set_aside_later(out_dir: Path, resumed: Path, log: Callable[[str], None]) -> None:
    """Checkpoints after the resumed one belong to a future this run abandons: move them aside (with a
    copy of metrics.jsonl, whose later lines the resumed run rewrites)."""
    step = ckpt.step_of(resumed)
    later = [p for p in ckpt.list_checkpoints(out_dir) if ckpt.step_of(p) > step]
    if not later:
        return
    metrics = out_dir / run_dir.METRICS_FILE
    moved = run_dir.move_aside(out_dir, later, copies=[metrics] if metrics.is_file() else [], label="after-" + resumed.name)
    log(f"resuming from {resumed.name}: the {len(later)} later checkpoint(s) ({', '.join(p.name for p in later)}) "
        f"and a copy of {run_dir.METRICS_FILE} moved to {moved}")


# ---- restoring state ------------------------------------------------------------------------

def _architecture_diff(ckpt_dir: Path, cfg: Config) -> str:
    """'model.hidden_size: 64 there, 32 here' for the model.*/moe.* keys that differ, or ''."""
    try:
        theirs = yaml.safe_load((ckpt_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""
    mine = cfg.to_dict()
    diffs = []
    for section in ("model", "moe"):
        for key, value in (theirs.get(section) or {}).items():
            if key in mine[section] and mine[section][key] != value and key not in ("name", "backend", "from_hf"):
                diffs.append(f"{section}.{key}: {value} there, {mine[section][key]} here")
    return "; ".join(diffs[:3])


def check_shapes(model: torch.nn.Module, saved: dict, ckpt_dir: Path, cfg: Config) -> None:
    """One line naming the first parameter that is missing, unexpected or shaped differently. A pipeline rank's
    model names what other ranks hold in ``keys_elsewhere``: those may be in the checkpoint."""
    mine = model.state_dict()
    elsewhere = getattr(model, "keys_elsewhere", set())
    problem = None
    for name, tensor in mine.items():
        if name not in saved:
            problem = f"{name} is missing from the checkpoint"
        elif tuple(saved[name].shape) != tuple(tensor.shape):
            problem = f"{name} is {list(saved[name].shape)} there and {list(tensor.shape)} here"
        if problem:
            break
    if problem is None:
        extra = [k for k in saved if k not in mine and k not in elsewhere]
        if extra:
            problem = f"the checkpoint has {extra[0]}, which this model does not"
    if problem is None:
        return
    diff = _architecture_diff(ckpt_dir, cfg)
    because = f" (its config differs: {diff})" if diff else ""
    raise UserError(f"checkpoint {ckpt_dir} does not fit this model: {problem}{because}; resume with the "
                    "checkpoint's model.* and moe.* settings, or start a new run in another train.out_dir")


def upgrade_legacy_names(state: dict) -> None:
    """A checkpoint saved before the dense MLPs were split into gate/up/down (models/legacy.py): the
    same renames for the weights and for their optimizer moments (and master copies), in place."""
    plan = legacy_mlp_plan({k: tuple(v.shape) for k, v in state["model"].items()})
    if not plan:
        return
    state["model"] = apply_plan(state["model"], plan)
    moments = (state.get("optimizer") or {}).get("params")
    if moments is not None:
        state["optimizer"]["params"] = apply_plan(
            moments, plan, take=lambda entry, rows: {k: t[rows] for k, t in entry.items()})


def load_into(start: RunStart, cfg: Config, model, optimizer, data, explicit: bool,
              log: Callable[[str], None]) -> tuple[Path, dict]:
    """Restore the newest usable candidate into model, optimizer and data; returns (its path, trainer state).
    Under a process group every rank calls this and takes the same decisions (a check failing on one rank's
    shards fails on all)."""
    for i, path in enumerate(start.candidates):
        try:  # the first candidate was verified by resume_candidates; older ones are verified here
            trainer = _load_weights(path, i == 0, cfg, model, optimizer)
        except ckpt.DamagedCheckpoint as err:
            if explicit:
                raise ckpt.explicit_damaged(str(path), err.reason) from None
            log(f"skipping damaged checkpoint {path}: {err.reason}")
            start.skipped.append(path)
            continue
        data.load_state_dict(trainer["data"])
        ckpt.set_rng_state(trainer["rng"])
        return path, trainer
    raise UserError("checkpoint.resume = auto: no checkpoint could be restored (each was damaged: "
                    f"{', '.join(p.name for p in start.skipped)}); start over with train.overwrite=true")


def _load_weights(path: Path, verified: bool, cfg: Config, model, optimizer) -> dict:
    """The checkpoint's weights and optimizer state into ``model`` and ``optimizer`` (whole or sharded, from a
    whole or sharded checkpoint); returns this rank's trainer state. DamagedCheckpoint where it does not verify
    or holds non-finite values."""
    from moetrain.train import sharded_checkpoint as sc

    sharded_model = sc.is_sharded(model)
    if ckpt.read_meta(path).get("format_version") == ckpt.SHARDED_FORMAT and sharded_model:
        reason = None if verified else ckpt.verify(path)
        if reason is not None:
            raise ckpt.DamagedCheckpoint(path, reason)
        check_shapes(model, sc.saved_shapes(path), path, cfg)
        sc.load_sharded(path, model, optimizer)
        trainer = sc.load_trainer(path, sc.rank_and_world()[0])
    else:
        state = ckpt.load_checkpoint(path, "cpu", check_finite=False, verified=verified)
        upgrade_legacy_names(state)
        check_shapes(model, state["model"], path, cfg)
        try:
            if sharded_model:
                sc.scatter_full(state, model, optimizer)
            else:
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
        except (ValueError, RuntimeError, KeyError) as err:
            raise UserError(f"checkpoint {path}: its optimizer state does not fit this run "
                            f"({str(err).splitlines()[0]})") from None
        trainer = state["trainer"]
    local = sc.local_view
    bad = ckpt.non_finite_state(local(model.state_dict()), local(optimizer.state_dict()))  # on the device: fast
    bad = next((b for b in sc.gather(bad) if b is not None), None)
    if bad is not None:
        raise ckpt.DamagedCheckpoint(path, ckpt.non_finite_reason(*bad))
    return trainer
