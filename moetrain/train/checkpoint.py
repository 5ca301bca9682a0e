"""Checkpoints under <out_dir>/checkpoints/step_<N>/: atomic, verified, and safe to load.

Layout of one checkpoint (format 2):

* ``model.pt``, ``optimizer.pt``: state dicts of tensors;
* ``trainer.pt``: step, data position and RNG states as tensors, ints and strings only;
* ``config.yaml``: the resolved config; ``meta.json``: format, step, run id, time;
* ``manifest.json``, written last: every other file's size and CRC-32.

Every ``.pt`` file loads with ``torch.load(weights_only=True)``: nothing in a checkpoint can run
code. The files are written into ``step_<N>.partial`` and renamed into place once the manifest is
on disk, so a crash, a kill or a full disk leaves at most a ``.partial`` directory, which loading
ignores and the next save removes. Loading checks the manifest (a truncated or overwritten file is
named, not loaded) and refuses non-finite weights or optimizer state.

The manifest lists files by path relative to the checkpoint directory, so a sharded checkpoint
(format 3, written by every rank of a distributed run: ``sharded_checkpoint``) carries the same
manifest, each rank contributing its files' entries; ``load_checkpoint`` reads it whole.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from moetrain.errors import UserError, format_bytes, free_bytes, os_error

FORMAT_VERSION = 2
LEGACY_FORMAT = 1  # trainer.pt pickled numpy arrays; read with a numpy-only allowlist, no manifest
SHARDED_FORMAT = 3  # one DCP shard file per rank (train/sharded_checkpoint.py), the same manifest
READABLE = (LEGACY_FORMAT, FORMAT_VERSION, SHARDED_FORMAT)
MANIFEST = "manifest.json"
CHECKSUM = "crc32"
STATE_FILES = ("model.pt", "optimizer.pt", "trainer.pt")
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 16 << 20


class DamagedCheckpoint(UserError):
    """A checkpoint that is incomplete, truncated, corrupted or holds non-finite values."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = path, reason


@dataclass
class Saved:
    path: Path
    bytes: int
    seconds: float


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if not match:
        raise ValueError(f"not a checkpoint directory name: {path.name}")
    return int(match.group(1))


# ---- RNG states in weights-only form -----------------------------------------------------------

def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) RNG states as tuples, ints, floats and tensors."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    if isinstance(n, dict):
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    else:  # format 1: numpy's own tuple
        np.random.set_state(n)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- writing -----------------------------------------------------------------------------------

class _ChecksumWriter:
    """A binary file that keeps the size and CRC-32 of everything written through it."""

    def __init__(self, f):
        self.f, self.bytes, self.crc = f, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_file(path: Path, obj=None, text: str | None = None) -> dict:
    """Write ``obj`` with torch.save (or ``text``), fsync, and return its manifest entry."""
    with open(path, "wb") as f:
        out = _ChecksumWriter(f)
        if text is not None:
            out.write(text.encode())
        else:
            torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": out.bytes, CHECKSUM: f"{out.crc:08x}"}


def state_bytes(obj) -> int:
    """Bytes of the tensors in a nested state (what a save writes, give or take a few KiB)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def intact_before(out_dir: Path, step: int) -> str:
    """What the user can fall back on, for error messages."""
    earlier = [p for p in list_checkpoints(out_dir) if step_of(p) != step and verify(p) is None]
    return f"the previous checkpoint {earlier[-1]} is intact" if earlier else "no earlier checkpoint exists"


def save_checkpoint(out_dir: str | Path, step: int, *, model_state: dict, optimizer_state: dict,
                    trainer_state: dict, config_yaml: str, run_id: str, keep_last: int = 0) -> Saved:
    """Write step_<step> atomically; then keep only the newest ``keep_last`` of run ``run_id`` (0 keeps all).

    Raises UserError (the previous checkpoint untouched, nothing partial left) when the disk is full or
    not writable; a KeyboardInterrupt mid-save also removes the partial directory before propagating.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    root = checkpoint_root(out_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.partial"
    needed = state_bytes(model_state) + state_bytes(optimizer_state) + state_bytes(trainer_state) + len(config_yaml)
    doing = f"saving checkpoint {final}"
    try:
        no_room = begin_save(root, tmp, needed)
        if no_room is not None:
            raise UserError(f"{doing}: {no_room}; {intact_before(out_dir, step)}")
        files = {
            "model.pt": write_file(tmp / "model.pt", model_state),
            "optimizer.pt": write_file(tmp / "optimizer.pt", optimizer_state),
            "trainer.pt": write_file(tmp / "trainer.pt", trainer_state),
            "config.yaml": write_file(tmp / "config.yaml", text=config_yaml),
        }
        meta = {"format_version": FORMAT_VERSION, "step": step, "run_id": run_id, "saved_at": time.time()}
        files["meta.json"] = write_file(tmp / "meta.json", text=json.dumps(meta))
        manifest = {"format_version": FORMAT_VERSION, "checksum": CHECKSUM, "files": files}
        write_file(tmp / MANIFEST, text=json.dumps(manifest, indent=1))
        install(tmp, final)
        fsync_dir(root)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise os_error(err, doing, needed_bytes=needed, after=intact_before(out_dir, step)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last > 0:
        prune(out_dir, run_id, keep_last)
    total = sum(entry["bytes"] for entry in files.values())
    return Saved(final, total, time.perf_counter() - started)


def begin_save(root: Path, tmp: Path, needed: int) -> str | None:
    """The checkpoints directory made, stale partial saves removed and, when ``needed`` bytes fit, the partial
    directory ``tmp`` made; else what is short ("not enough disk space: ..."). OSError as the file system raises."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    free = free_bytes(root)
    if free is not None and free < needed:
        return f"not enough disk space: needs about {format_bytes(needed)}, {format_bytes(free)} free"
    tmp.mkdir()
    return None


def install(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an older ``final`` (the same step saved again) is replaced only after."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(final.name + ".replaced.partial")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def prune(out_dir: str | Path, run_id: str, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints of run ``run_id``; returns the deleted.

    Checkpoints of other runs, incomplete or truncated ones and those of the old format are never deleted
    here. Completeness is read from the manifest and the file sizes: checksumming every kept checkpoint
    on every save would read them all again."""
    mine = [p for p in list_checkpoints(out_dir)
            if read_meta(p).get("run_id") == run_id and verify(p, checksums=False) is None]
    doomed = mine[:-keep_last] if keep_last > 0 else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# ---- reading -----------------------------------------------------------------------------------

def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Every step_<N> directory under out_dir/checkpoints (intact or not), oldest first."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=step_of)


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint, or {} when it is missing or unreadable (verify says why)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def verify(path: Path, only: tuple[str, ...] | None = None, checksums: bool = True) -> str | None:
    """None when the checkpoint at ``path`` is complete and matches its manifest, else what is wrong.
    ``only`` limits the file checks to those files (e.g. model.pt for an export); without ``checksums``
    only sizes are compared (no file is read)."""
    if not (path / "meta.json").is_file():
        return "no meta.json (the save did not finish)"
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as err:
        return f"meta.json is not valid JSON ({err})"
    if not isinstance(meta, dict) or "format_version" not in meta:
        return "meta.json holds no format_version"
    version = meta["format_version"]
    if version == LEGACY_FORMAT:
        missing = [f for f in STATE_FILES if not (path / f).is_file()]
        return f"missing {', '.join(missing)}" if missing else None
    if version not in READABLE:
        return f"checkpoint format {version!r} is not one this moetrain reads ({', '.join(map(str, READABLE))})"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} is unreadable ({err})"
    for name, entry in files.items():
        if only is not None and name not in only:
            continue
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"{name} is {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
        if checksums and crc32(file) != entry[CHECKSUM]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def _legacy_trainer(file: Path) -> dict:
    # Format 1 pickled numpy's RNG state: allow exactly numpy's array reconstruction, nothing else.
    core = getattr(np, "_core", None) or np.core
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct]
    with torch.serialization.safe_globals(allowed):
        return torch.load(file, map_location="cpu", weights_only=True)


def first_non_finite(state, prefix: str = "") -> str | None:
    """The dotted name of the first floating tensor in a nested state with a NaN or inf, else None."""
    tensors = []

    def walk(obj, name):
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point():
                tensors.append((name, obj))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{name}.{k}" if name else str(k))

    walk(state, prefix)
    if not tensors:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in tensors]).cpu()  # one sync for all
    bad = [name for (name, _), ok in zip(tensors, finite.tolist()) if not ok]
    return bad[0] if bad else None


def non_finite_state(model_state: dict, optimizer_state: dict) -> tuple[str, str] | None:
    """(file, tensor name) of the first NaN or inf in a model or optimizer state dict, else None."""
    for what, state in (("model.pt", model_state), ("optimizer.pt", optimizer_state)):
        bad = first_non_finite(state)
        if bad is not None:
            return what, bad
    return None


def load_checkpoint(path: Path, device: str | torch.device = "cpu", *, check_finite: bool = True,
                    verified: bool = False) -> dict:
    """Verify (unless ``verified`` says the caller just did) and read a checkpoint (tensors on ``device``;
    memory-mapped on the CPU).

    Raises DamagedCheckpoint when the files do not match the manifest or cannot be read, and, with
    ``check_finite``, when the weights or optimizer state hold a NaN or inf (the trainer checks them
    on its device after loading instead: faster than on the host).
    """
    reason = None if verified else verify(path)
    if reason is not None:
        raise DamagedCheckpoint(path, reason)
    meta = read_meta(path)
    if meta["format_version"] == SHARDED_FORMAT:
        from moetrain.train.sharded_checkpoint import load_full

        state = load_full(path, device)
        bad = non_finite_state(state["model"], state["optimizer"]) if check_finite else None
        if bad is not None:
            raise DamagedCheckpoint(path, non_finite_reason(*bad))
        return {"meta": meta, **state}
    mmap = torch.device(device).type == "cpu"
    try:
        model = torch.load(path / "model.pt", map_location=device, weights_only=True, mmap=mmap)
        optimizer = torch.load(path / "optimizer.pt", map_location=device, weights_only=True, mmap=mmap)
        if meta["format_version"] == LEGACY_FORMAT:
            trainer = _legacy_trainer(path / "trainer.pt")
        else:
            trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        unsafe = re.search(r"GLOBAL (\S+)", str(err))
        what = f" ({unsafe.group(1)})" if unsafe else ""
        raise DamagedCheckpoint(path, f"cannot be read safely: it holds objects other than tensors and plain "
                                      f"values{what}, which could run code; refused") from None
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise DamagedCheckpoint(path, f"cannot be read ({str(err).splitlines()[0]})") from None
    bad = non_finite_state(model, optimizer) if check_finite else None
    if bad is not None:
        raise DamagedCheckpoint(path, non_finite_reason(*bad))
    return {"meta": meta, "model": model, "optimizer": optimizer, "trainer": trainer}


def non_finite_reason(what: str, name: str) -> str:
    return f"{what} holds non-finite values (NaN or inf) in {name}"


def resume_candidates(resume: str | None, out_dir: str | Path,
                      warn: Callable[[str], None]) -> tuple[list[Path], list[Path]]:
    """checkpoint.resume -> (checkpoints to try, newest first; damaged ones skipped).

    The first candidate has been verified against its manifest, the older ones (fallbacks for a
    checkpoint that turns out to hold non-finite values) not yet: 'auto' verifies newest first, warning
    about each damaged one, and stops at the first intact one. An explicit path must be intact, else a
    one-line UserError says what is wrong with it.
    """
    if resume is None:
        return [], []
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise UserError(f"checkpoint.resume = {resume}: no such checkpoint directory")
        reason = verify(path)
        if reason is not None:
            raise explicit_damaged(resume, reason)
        return [path], []
    newest_first, skipped = list(reversed(list_checkpoints(out_dir))), []
    for i, path in enumerate(newest_first):
        reason = verify(path)
        if reason is None:
            return newest_first[i:], skipped
        warn(f"skipping damaged checkpoint {path}: {reason}")
        skipped.append(path)
    return [], skipped


def explicit_damaged(resume: str, reason: str) -> UserError:
    return UserError(f"checkpoint.resume = {resume}: {reason}; pick another checkpoint "
                     "(or checkpoint.resume=auto for the newest intact one)")


def latest_intact(out_dir: str | Path) -> Path | None:
    """The newest checkpoint under out_dir that matches its manifest, or None."""
    for path in reversed(list_checkpoints(out_dir)):
        if verify(path) is None:
            return path
    return None
