"""Small JSON caches of run-time measurements in $MOETRAIN_CACHE_DIR (default ~/.cache/moetrain/): the tuner's
decisions (moetrain.tuning.cache).

File layout: {"version": int, "entries": {key: {...}}}. Written atomically (temp file + rename), so a reader
sees the old file or the new one. A file of another version is ignored quietly (measured again, then
overwritten); one that does not parse is ignored with one warning. A cache that cannot be written warns and
the measurement stays in memory: a read-only home must not stop training. Plain Python (no torch, no triton).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable


def cache_dir() -> Path:
    root = os.environ.get("MOETRAIN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moetrain")
    return Path(root)


def read_entries(path: Path, version: int, valid: Callable[[dict], bool], what: str, quiet: bool = False) -> dict:
    """The entries of ``path`` that ``valid`` accepts ({} when missing, of another version or unreadable)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("version"), int) and data["version"] != version:
            return {}  # measured by another moetrain version, perhaps another way
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("unexpected layout")
        return {k: v for k, v in data["entries"].items() if isinstance(v, dict) and valid(v)}
    except (OSError, ValueError) as err:
        if not quiet:
            warnings.warn(f"moetrain: ignoring unreadable {what} {path} ({err}); it will be rewritten",
                          RuntimeWarning, stacklevel=3)
        return {}


def write_entries(path: Path, version: int, entries: dict, what: str) -> None:
    """Atomic: readers see the old file or the new one, never a partial write."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": version, "entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as err:
        warnings.warn(f"moetrain: could not write {what} {path} ({err})", RuntimeWarning, stacklevel=3)


def merge_and_write(path: Path, version: int, mine: dict, valid: Callable[[dict], bool], what: str) -> None:
    """Write ``mine`` over what other processes may have added to the file since it was read."""
    entries = read_entries(path, version, valid, what, quiet=True)
    entries.update(mine)
    write_entries(path, version, entries, what)
