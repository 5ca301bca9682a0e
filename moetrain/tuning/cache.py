"""The tuner's one cache file: $MOETRAIN_CACHE_DIR/tuning.json (default ~/.cache/moetrain/), written atomically
(runtime.disk_cache). An entry is keyed by the question's full key string (kind, dtype, shape, variant, GPU name,
triton and torch versions) and holds the winner's label (str of the candidate) and every candidate's times; a
winner that is no longer among the candidates is measured again. A file of another VERSION is measured again
quietly; one that does not parse is ignored with one warning and rewritten."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from moetrain.runtime import cuda_device, disk_cache

FILE = "tuning.json"
VERSION = 1
WHAT = "tuning cache"


def rows_bucket(rows: int, groups: int) -> int:
    """Rows per group rounded up to a power of two (1, 2, 4, ...): the shape bucket questions are keyed by."""
    per_group = max(1, rows // max(groups, 1))
    return 1 << (per_group - 1).bit_length()


def device_label(device: torch.device) -> str:
    """The GPU's name (a CPU: "cpu"), part of every key."""
    return cuda_device.device_name(device) if device.type == "cuda" else device.type


def versions() -> str:
    triton = sys.modules.get("triton")
    return f"triton {getattr(triton, '__version__', '-')}|torch {torch.__version__}"


def key_string(kind: str, dtype: torch.dtype, device: torch.device, n: int, k: int, rows: int, groups: int,
               variant: tuple) -> str:
    flags = ",".join(str(v) for v in variant)
    return (f"{kind}|{str(dtype).removeprefix('torch.')}|N{n}|K{k}|b{rows_bucket(rows, groups)}|{flags}|"
            f"{device_label(device)}|{versions()}")


def _valid(entry: dict) -> bool:
    return isinstance(entry.get("choice"), str)


class CacheFile:
    """The entries of one cache file, read once (lazily) and merged with other processes' writes on each write."""

    def __init__(self, path: Path | str | None = None):
        self._path = Path(path) if path is not None else None
        self._entries: dict | None = None

    @property
    def path(self) -> Path:
        return self._path if self._path is not None else disk_cache.cache_dir() / FILE

    def entries(self) -> dict:
        if self._entries is None:
            self._entries = disk_cache.read_entries(self.path, VERSION, _valid, WHAT)
        return self._entries

    def choice(self, key: str) -> str | None:
        entry = self.entries().get(key)
        return entry["choice"] if entry else None

    def record(self, key: str, entry: dict) -> None:
        self.entries()[key] = entry
        disk_cache.merge_and_write(self.path, VERSION, self.entries(), _valid, WHAT)
