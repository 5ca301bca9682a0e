"""Streaming safetensors I/O for the HF interop: load pieces into tensors, write sharded files.

Reading goes piece by piece in shard order with at most two shards open (``safe_open`` maps
the file and ``get_tensor`` copies out one tensor), each HF tensor is transformed and copied
into its slice of the preallocated moetrain tensor: peak extra memory is a few HF tensors, never
a second copy of the model. Every name and shape is checked against the headers *before*
anything is read, so a wrong checkpoint fails fast with a message naming the tensors.

Writing assigns whole pieces to shards of at most ``max_shard_size`` bytes (computed from
shapes alone), then materialises one shard at a time: ``model.safetensors`` when one shard
suffices, else ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` (the HF
convention, which the moetrain model directory uses too).
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from moetrain.errors import UserError
from moetrain.models.hf_files import INDEX, SINGLE, CheckpointFiles
from moetrain.models.hf_families import Piece, load_piece, save_piece
from moetrain.models.legacy import legacy_mlp_plan

SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
DEFAULT_SHARD_SIZE = "5GB"


def parse_size(size: int | str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2^20, plain ints as bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not match:
        raise UserError(f"shard size {size!r}: expected bytes or e.g. 5GB, 500MiB")
    number, unit, binary = match.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _progress(enabled: bool, total: int, what: str):
    """(context manager, advance(n_bytes)) showing a rich byte progress bar on stderr."""
    if not enabled:
        return nullcontext(), lambda n: None
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    bar = Progress(TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True))
    task = bar.add_task(what, total=total)
    return bar, lambda n: bar.advance(task, n)


class _Reader:
    """get(name) -> tensor, opening shards lazily and keeping at most ``max_open`` open."""

    def __init__(self, files: CheckpointFiles, max_open: int = 2):
        self.files, self.max_open = files, max_open
        self.open: OrderedDict[str, object] = OrderedDict()

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files.file_of[name]
        if file not in self.open:
            if len(self.open) >= self.max_open:
                self.open.popitem(last=False)
            self.files.header(file)  # checks the header against the file size first
            try:
                self.open[file] = safe_open(str(self.files.dir / file), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise UserError(f"{self.files.dir / file}: cannot open safetensors file ({err})") from None
        self.open.move_to_end(file)
        return self.open[file].get_tensor(name)


def expected_shapes(piece: Piece, targets: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """HF shapes of a piece, from the target shapes (export transforms on meta tensors)."""
    if piece.shapes is not None:
        return [tuple(s) for s in piece.shapes]
    if piece.ours is None:
        if piece.copy_of.startswith("zeros:"):
            return [(int(piece.copy_of.split(":")[1]),)]
        return [tuple(targets[piece.copy_of].shape)]
    meta = torch.empty(targets[piece.ours].shape, device="meta")
    if piece.index is not None:
        meta = meta[piece.index]
    return [tuple(t.shape) for t in save_piece(piece, meta)]


def check_coverage(pieces: list[Piece], targets: dict[str, torch.Tensor], what: str) -> None:
    """Every target element is written exactly once (a layout bug otherwise, not a user error)."""
    filled: dict[str, int] = {}
    for p in pieces:
        if p.ours is None:
            continue
        if p.ours not in targets:
            raise RuntimeError(f"{what}: layout names {p.ours}, which the model does not have")
        t = torch.empty(targets[p.ours].shape, device="meta")  # shapes only (a sharded target is never gathered)
        n = t[p.index].numel() if p.index is not None else t.numel()
        filled[p.ours] = filled.get(p.ours, 0) + n
    bad = [k for k, t in targets.items() if filled.get(k, 0) != t.numel()]
    if bad:
        raise RuntimeError(f"{what}: the layout does not fill {_listed(bad)} exactly once")


FP8_SCALE_SUFFIX = "_scale_inv"


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-scaled FP8 (DeepSeek-V3 style): w [R, C] float8, scale_inv [ceil(R/b0), ceil(C/b1)];
    value = w * scale_inv of its (b0 x b1) block. Returns fp32 [R, C]."""
    R, C = w.shape
    b0, b1 = block
    if tuple(scale_inv.shape) != (-(-R // b0), -(-C // b1)):
        raise UserError(f"FP8 scale_inv shape {list(scale_inv.shape)} does not match weight {[R, C]} "
                        f"with blocks of {list(block)}")
    scale = scale_inv.float().repeat_interleave(b0, 0)[:R].repeat_interleave(b1, 1)[:, :C]
    return w.float() * scale


@torch.no_grad()
def load_pieces(targets: dict[str, torch.Tensor], pieces: list[Piece], files: CheckpointFiles, *,
                skip: Callable[[str], bool] = lambda name: False, progress: bool = False,
                fp8_block: Optional[tuple[int, int]] = None) -> None:
    """Fill ``targets`` (name -> tensor, written in place) from the checkpoint ``files``.

    UserError naming the tensors when the checkpoint lacks some, has unexpected ones (not in
    any piece and not ``skip``-ped), or has a shape that differs from the model's.
    ``fp8_block``: the checkpoint is block-scaled FP8; a tensor ``X`` with a sibling
    ``X_scale_inv`` is dequantized on the fly.
    """
    where = files.dir
    available = set(files.names())
    wanted: set[str] = set()
    for p in pieces:
        wanted.update(p.hf)
    scale_of: dict[str, str] = {}
    if fp8_block is not None:
        scale_of = {n[:-len(FP8_SCALE_SUFFIX)]: n for n in available
                    if n.endswith(FP8_SCALE_SUFFIX) and n[:-len(FP8_SCALE_SUFFIX)] in wanted}
        wanted.update(scale_of.values())
    missing = [n for p in pieces if p.ours is not None for n in p.hf if n not in available]
    if missing:
        raise UserError(f"{where}: missing tensor(s) {_listed(missing)}")
    unexpected = [n for n in files.names() if n not in wanted and not skip(n)]
    if unexpected:
        raise UserError(f"{where}: unexpected tensor(s) {_listed(unexpected)} (not part of this architecture)")
    for p in pieces:
        present = [n for n in p.hf if n in available]
        if not present:
            continue
        for name, shape in zip(p.hf, expected_shapes(p, targets)):
            got = files.shape(name)
            if got != shape:
                raise UserError(f"{where}: tensor {name} has shape {list(got)}, expected {list(shape)}")

    order = {f: i for i, f in enumerate(files.files)}
    todo = sorted((p for p in pieces if p.ours is not None), key=lambda p: order[files.file_of[p.hf[0]]])
    total = sum(_nbytes(files, n) for p in todo for n in p.hf)
    bar, advance = _progress(progress, total, "loading weights")
    reader = _Reader(files)

    def get(name: str) -> torch.Tensor:
        t = reader.get(name)
        if name in scale_of:
            t = dequantize_fp8_blocks(t, reader.get(scale_of[name]), fp8_block)
        return t

    with bar:
        for p in todo:
            dest, commit = _destination(targets[p.ours], p.index)
            if dest is not None:  # a sharded model: this rank holds part of it (a whole expert's rows, or a slice)
                load_piece(p, [get(n) for n in p.hf], dest)
                commit()
            advance(sum(_nbytes(files, n) for n in p.hf))


def _destination(target: torch.Tensor, index: Optional[tuple]) -> tuple[Optional[torch.Tensor], Callable[[], None]]:
    """(where a piece is loaded, what then moves it into ``target``). A plain tensor: itself (or its row
    ``index``). A DTensor (a sharded model, each shard a contiguous range in every dim: FSDP2, expert and tensor
    parallelism): for an indexed piece (an expert of a stacked weight, split on dim 0 only), the local row where this
    rank holds it, else None (not read at all); otherwise a whole-shape temporary on the CPU whose local block is
    then copied in (one tensor in memory at a time, never the model)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return (target if index is None else target[index]), lambda: None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = target.to_local()
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if index is not None:  # (expert, [rows]): the expert is dim 0
        if tuple(shape[1:]) != tuple(target.shape[1:]):
            raise NotImplementedError(f"loading an expert into a DTensor sharded beyond dim 0 ({target.placements})")
        start, rows, k = offset[0], shape[0], index[0]
        return (local[(k - start, *index[1:])] if start <= k < start + rows else None), lambda: None
    whole = torch.empty(target.shape, dtype=local.dtype)
    block = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return whole, lambda: local.copy_(whole[block])


def _nbytes(files: CheckpointFiles, name: str) -> int:
    n = 1
    for s in files.shape(name):
        n *= s
    return n * SAFETENSORS_DTYPES.get(files.dtype(name), 4)


# ---- writing ----------------------------------------------------------------------------------

def _piece_outputs(piece: Piece, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    if piece.ours is None:
        if piece.copy_of.startswith("zeros:"):
            return [torch.zeros(int(piece.copy_of.split(":")[1]), dtype=torch.float32)]
        return [tensors[piece.copy_of]]
    t = tensors[piece.ours]
    return save_piece(piece, t if piece.index is None else t[piece.index])


def write_pieces(out_dir: str | Path, pieces: list[Piece], tensors: dict[str, torch.Tensor], *,
                 dtype_of: Callable[[str, torch.Tensor], torch.dtype], max_shard_size: int | str = DEFAULT_SHARD_SIZE,
                 progress: bool = False) -> list[Path]:
    """Write the HF tensors of ``pieces`` (built from ``tensors``) as safetensors shards in
    ``out_dir``; ``dtype_of(hf_name, tensor)`` picks each output dtype. Returns the files.

    An OSError while writing (full disk, read-only directory) propagates after the files this
    call wrote are removed, with ``needed_bytes`` set to the size of all shards."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in tensors.items()}
    # Plan: whole pieces per shard, sizes from meta tensors.
    shards: list[list[Piece]] = [[]]
    sizes = [0]
    weight_map: dict[str, int] = {}
    for p in pieces:
        outs = _piece_outputs(p, meta)
        n = sum(t.numel() * torch.empty((), dtype=dtype_of(name, t)).element_size() for name, t in zip(p.hf, outs))
        if sizes[-1] and sizes[-1] + n > limit:
            shards.append([])
            sizes.append(0)
        shards[-1].append(p)
        sizes[-1] += n
        for name in p.hf:
            if name in weight_map:
                raise RuntimeError(f"export layout writes {name} twice")
            weight_map[name] = len(shards) - 1
    count = len(shards)
    names = [SINGLE] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
    bar, advance = _progress(progress, sum(sizes), "writing weights")
    written: list[Path] = []
    try:
        with bar:
            for shard, fname, size in zip(shards, names, sizes):
                data: dict[str, torch.Tensor] = {}
                for p in shard:
                    for name, t in zip(p.hf, _piece_outputs(p, tensors)):
                        # A fresh contiguous copy: slices of one stacked tensor must not share storage.
                        data[name] = t.detach().to(device="cpu", dtype=dtype_of(name, t),
                                                   memory_format=torch.contiguous_format, copy=True)
                written.append(out / fname)
                _save_file(data, out / fname)
                del data
                advance(size)
        if count > 1:
            index = {"metadata": {"total_size": sum(sizes)},
                     "weight_map": {name: names[k] for name, k in sorted(weight_map.items())}}
            written.append(out / INDEX)
            (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    except OSError as err:
        for path in written:  # no partial checkpoint: an incomplete set of shards loads as garbage
            path.unlink(missing_ok=True)
        err.needed_bytes = sum(sizes)
        raise
    keep = set(names) | ({INDEX} if count > 1 else set())
    for stale in weight_files(out):  # a previous checkpoint's other shard layout, once this one is complete
        if stale.name not in keep:
            stale.unlink()
    return [out / n for n in names]


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors weight files in ``directory``: model.safetensors, the index, the shards."""
    d = Path(directory)
    return [p for p in (d / SINGLE, d / INDEX, *sorted(d.glob("model-*-of-*.safetensors"))) if p.is_file()]


def _save_file(data: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with its I/O failures as OSError (it raises SafetensorError
    '... (os error N) ...' for a full disk or a read-only directory)."""
    from safetensors.torch import save_file

    try:
        save_file(data, str(path), metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None


def identity_pieces(names: Iterable[str]) -> list[Piece]:
    """moetrain's own format: every tensor under its own name."""
    return [Piece(n, (n,)) for n in names]


def moetrain_dir_pieces(targets: dict[str, torch.Tensor], files: CheckpointFiles) -> list[Piece]:
    """The pieces of a moetrain model directory: every tensor under its own name, except where the
    directory predates the gate/up/down split (legacy.py): then rows of its ``...mlp.w1``/``w2`` fill
    today's gate_proj/up_proj/down_proj."""
    plan = legacy_mlp_plan({n: files.shape(n) for n in files.names()})
    source = {new: (old, rows) for old, parts in plan.items() for new, rows in parts}
    pieces = []
    for name in targets:
        if name not in source:
            pieces.append(Piece(name, (name,)))
            continue
        old, rows = source[name]
        parts = [new for new, _ in plan[old]]
        # The legacy shape this model implies, so that a mismatch is reported by name like any other.
        shape = files.shape(old)
        if all(n in targets for n in parts):
            shape = (sum(targets[n].shape[0] for n in parts), *targets[name].shape[1:])
        pieces.append(Piece(name, (old,), load=lambda ts, rows=rows: ts[0][rows], shapes=(shape,)))
    return pieces


def state_targets(model) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a model, sharing storage (in-place copies update it)."""
    return dict(model.state_dict(keep_vars=False))


def read_all(files: CheckpointFiles, names: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
    reader = _Reader(files)
    return {n: reader.get(n) for n in (names or files.names())}
