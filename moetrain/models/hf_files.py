"""Hugging Face checkpoint files, read through their safetensors headers only (no tensor data).

``CheckpointFiles`` finds a directory's weights (one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``) and each tensor's dtype and shape; ``read_safetensors_header``
checks the header length against the file size first, so a damaged file is one line, not a huge
allocation. Pure Python: no torch.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from moetrain.errors import UserError, os_error

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_safetensors_header(path: Path) -> dict:
    """name -> {dtype, shape, data_offsets} of a safetensors file (``__metadata__`` dropped).

    Layout: an 8-byte little-endian header length N, N bytes of JSON, then the data. N is
    checked against the file size before anything is read, so a damaged file is a one-line
    UserError naming it, never an N-byte allocation.
    """
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise UserError(f"{path}: corrupt safetensors file: {size} bytes, shorter than its 8-byte "
                                "header length")
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise UserError(f"{path}: corrupt safetensors header: length {n} exceeds file size {size}")
            header = json.loads(fh.read(n))
    except OSError as err:
        raise os_error(err, f"reading {path}") from None
    except ValueError as err:  # bad JSON or UTF-8
        raise UserError(f"{path}: corrupt safetensors header: not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: corrupt safetensors header: expected a JSON object")
    header.pop("__metadata__", None)
    return header


class CheckpointFiles:
    """Tensor names -> files of a safetensors checkpoint, with shapes/dtypes from the headers."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        self.file_of: dict[str, str] = {}
        self._headers: dict[str, dict] = {}
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise UserError(f"{index}: not a valid safetensors index ({err})") from None
            self.file_of = dict(weight_map)
            for f in dict.fromkeys(self.file_of.values()):
                if not (self.dir / f).is_file():
                    raise UserError(f"{index} lists shard {f}, which is missing from {self.dir}")
        else:
            files = [self.dir / SINGLE] if (self.dir / SINGLE).is_file() else sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise UserError(f"{self.dir}: no safetensors weights (expected {SINGLE} or {INDEX})")
            for f in files:
                for name in self.header(f.name):
                    self.file_of[name] = f.name
        self.files = list(dict.fromkeys(self.file_of.values()))

    def header(self, file: str) -> dict:
        """The tensor entries of ``file``'s header (checked against the file size before reading)."""
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(self.dir / file)
        return self._headers[file]

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        info = self.header(self.file_of[name]).get(name)
        if info is None:
            raise UserError(f"{self.dir / self.file_of[name]}: tensor {name} listed in the index is missing")
        return tuple(info["shape"])

    def dtype(self, name: str) -> str:
        return self.header(self.file_of[name])[name]["dtype"]


def mtp_layers_present(files: CheckpointFiles, hf: dict) -> int:
    """How many DeepSeek MTP depths (HF layers num_hidden_layers + d) have weights."""
    L, n = hf.get("num_hidden_layers", 0), hf.get("num_nextn_predict_layers") or 0
    names = set(files.names())
    d = 0
    while d < n and f"model.layers.{L + d}.eh_proj.weight" in names:
        d += 1
    return d
