"""Sharded checkpoints (format 3): every rank writes its shards with ``torch.distributed.checkpoint`` (DCP).

Layout of ``step_<N>/`` (written into ``step_<N>.partial/`` and renamed by rank 0 once every rank is done):

* ``state/``: the DCP checkpoint of ``{"model": ..., "optimizer": ...}``: one ``.distcp`` file per rank and
  ``.metadata`` (global shapes and where each shard lies). Parameters keep their single-device names and global
  shapes, so a checkpoint saved under one layout loads under any other (DCP reads each rank's part of each
  tensor), including one process;
* ``trainer/rank_<r>.pt``: rank r's step, data position and RNG state;
* ``config.yaml``, ``meta.json`` (format 3, the world size and parallel degrees), and ``manifest.json``: every
  file's size and CRC-32, each rank checksumming its share of the files.

The out_dir must be one filesystem that every rank sees (a shared one across nodes).

Loading: a sharded model reads its shards in place (``load_sharded``); a single-device one reads whole tensors
(``load_full``, also what ``checkpoint.load_checkpoint`` returns for ``moetrain export``); a format-2
checkpoint loads into a sharded model by slicing each rank's part out of the memory-mapped tensors
(``scatter_full``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from moetrain.errors import UserError, os_error
from moetrain.train import checkpoint as ckpt

STATE_DIR = "state"
TRAINER_DIR = "trainer"


def trainer_file(rank: int) -> str:
    return f"{TRAINER_DIR}/rank_{rank}.pt"


# ---- the state every rank saves and loads in place ------------------------------------------------

def is_sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (an optimizer tensor shaped like the parameter's shard) as a DTensor with the parameter's
    placement; ``local`` itself for a plain parameter. Shares ``local``'s storage: DCP loads into it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def checkpoint_state(model, optimizer) -> dict:
    """{"model": model.state_dict(), "optimizer": {"step": n, "params": {name: {"exp_avg": ..., "exp_avg_sq": ...,
    ["master": ...]}}}}: DTensors (views of this rank's shards) for sharded parameters, so DCP saves each shard
    once and loads into these tensors in place."""
    params = {}
    for s in optimizer.slots:
        entry = {"exp_avg": _like_param(s.exp_avg, s.param), "exp_avg_sq": _like_param(s.exp_avg_sq, s.param)}
        if s.master is not None:
            entry["master"] = _like_param(s.master, s.param)
        params[s.name] = entry
    return {"model": model.state_dict(), "optimizer": {"step": optimizer.step_count, "params": params}}


def _local(t):
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def local_view(state):
    """A nested state with every DTensor replaced by its local shard (for per-rank checks)."""
    if isinstance(state, dict):
        return {k: local_view(v) for k, v in state.items()}
    return _local(state) if isinstance(state, torch.Tensor) else state


# ---- agreement between ranks ----------------------------------------------------------------------

def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(obj) -> list:
    """Every rank's ``obj`` (a one-element list outside a process group)."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def first_error(errors: list) -> str | None:
    """The first rank's error message among the gathered, as 'rank r: message', or None."""
    for rank, err in enumerate(errors):
        if err is not None:
            return f"rank {rank}: {err}" if len(errors) > 1 else err
    return None


# ---- saving ---------------------------------------------------------------------------------------

def _checksum_share(tmp: Path, rank: int, world: int) -> dict:
    """Manifest entries of this rank's share (every world-th, by sorted name) of the files under tmp/state."""
    files = sorted(p for p in (tmp / STATE_DIR).iterdir() if p.is_file())
    return {f"{STATE_DIR}/{p.name}": {"bytes": p.stat().st_size, ckpt.CHECKSUM: ckpt.crc32(p)}
            for p in files[rank::world]}


def save_sharded(out_dir: str | Path, step: int, *, state: dict, trainer_state: dict, config_yaml: str,
                 run_id: str, layout: dict, keep_last: int = 0) -> ckpt.Saved:
    """Write step_<step> from every rank (a collective: all ranks call it); atomic as the single-device save is:
    a failure on any rank leaves no step_<step>, removes the partial directory and raises the same UserError
    on every rank."""
    import torch.distributed.checkpoint as dcp

    started = time.perf_counter()
    rank, world = rank_and_world()
    root = ckpt.checkpoint_root(out_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.partial"
    doing = f"saving checkpoint {final}"
    local_bytes = ckpt.state_bytes(local_view(state)) + ckpt.state_bytes(trainer_state)

    def agree(err: str | None) -> None:
        message = first_error(gather(err))
        if message is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"{doing}: {message}; {ckpt.intact_before(out_dir, step)}")

    agree(_prepare(root, tmp, local_bytes * world) if rank == 0 else None)
    err, entries = None, {}
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp / STATE_DIR), single_file_per_rank=True))
        (tmp / TRAINER_DIR).mkdir(exist_ok=True)
        entries[trainer_file(rank)] = ckpt.write_file(tmp / trainer_file(rank), trainer_state)
    except OSError as e:
        err = str(os_error(e, "writing its shards", needed_bytes=local_bytes))
    except Exception as e:  # DCP raises CheckpointException on every rank when one rank's write fails
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    agree(err)
    try:
        entries.update(_checksum_share(tmp, rank, world))
    except OSError as e:
        err = str(os_error(e, "checksumming its shards"))
    agree(err)
    shares = gather(entries)
    err = None
    if rank == 0:
        try:
            _finish(tmp, final, root, shares, step, run_id, config_yaml, layout, world)
        except OSError as e:
            err = str(os_error(e, "writing the manifest"))
    agree(err)
    if rank == 0 and keep_last > 0:
        ckpt.prune(out_dir, run_id, keep_last)
    total = sum(e["bytes"] for share in shares for e in share.values())
    return ckpt.Saved(final, total, time.perf_counter() - started)


def _prepare(root: Path, tmp: Path, needed: int) -> str | None:
    """Rank 0: the checkpoints directory, stale partial saves removed, room checked, the partial directory made;
    the error's text, or None."""
    try:
        no_room = ckpt.begin_save(root, tmp, needed)
        if no_room is not None:
            return no_room
        (tmp / TRAINER_DIR).mkdir()
    except OSError as e:
        return str(os_error(e, "preparing the directory", needed_bytes=needed))
    return None


def _finish(tmp: Path, final: Path, root: Path, shares: list[dict], step: int, run_id: str, config_yaml: str,
            layout: dict, world: int) -> None:
    """Rank 0, after every rank wrote and checksummed its files: config, meta, manifest, then the rename."""
    files = {name: entry for share in shares for name, entry in share.items()}
    files["config.yaml"] = ckpt.write_file(tmp / "config.yaml", text=config_yaml)
    meta = {"format_version": ckpt.SHARDED_FORMAT, "step": step, "run_id": run_id, "saved_at": time.time(),
            "world_size": world, "layout": layout}
    files["meta.json"] = ckpt.write_file(tmp / "meta.json", text=json.dumps(meta))
    manifest = {"format_version": ckpt.SHARDED_FORMAT, "checksum": ckpt.CHECKSUM, "files": files}
    ckpt.write_file(tmp / ckpt.MANIFEST, text=json.dumps(manifest, indent=1))
    ckpt.install(tmp, final)
    ckpt.fsync_dir(root)


# ---- loading --------------------------------------------------------------------------------------

def _reader(path: Path):
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(path / STATE_DIR))


def _saved_keys(path: Path) -> dict:
    """{flattened key ("model.<name>", "optimizer.params.<name>.exp_avg", ...): its storage metadata}."""
    return _reader(path).read_metadata().state_dict_metadata


def saved_shapes(path: Path) -> dict[str, torch.Tensor]:
    """The saved model tensors as meta tensors of their global shapes (for ``resume.check_shapes``)."""
    return {key[len("model."):]: torch.empty(tuple(entry.size), device="meta")
            for key, entry in _saved_keys(path).items() if key.startswith("model.") and hasattr(entry, "size")}


def load_trainer(path: Path, rank: int) -> dict:
    """Rank ``rank``'s trainer state; rank 0's where the checkpoint was saved on fewer ranks (its RNG streams
    then restart from rank 0's, as a layout change makes them differ from the saved run's anyway)."""
    file = path / trainer_file(rank)
    if not file.is_file():
        file = path / trainer_file(0)
    return torch.load(file, map_location="cpu", weights_only=True)


def load_full(path: Path, device: str | torch.device = "cpu") -> dict:
    """{"model", "optimizer", "trainer"} of a sharded checkpoint as whole tensors (one process, no process group)."""
    # the loader format_utils.dcp_to_torch_save uses: it builds the state from the metadata (the public
    # dcp.load fills only the tensors it is given)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=_reader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    if torch.device(device).type != "cpu":
        state = {k: _to(v, device) for k, v in state.items()}
    return {"model": state["model"], "optimizer": state["optimizer"], "trainer": load_trainer(path, 0)}


def _to(obj, device):
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj.to(device) if isinstance(obj, torch.Tensor) else obj


def _missing_optimizer_keys(state: dict, saved: set[str]) -> list[str]:
    return [f"{name}.{k}" for name, entry in state["optimizer"]["params"].items()
            for k in ("exp_avg", "exp_avg_sq") if f"optimizer.params.{name}.{k}" not in saved]


def load_sharded(path: Path, model, optimizer) -> None:
    """The model's and optimizer's shards read in place from a sharded checkpoint saved under any layout (a
    collective: every rank calls it). UserError when the optimizer state does not fit this run."""
    import torch.distributed.checkpoint as dcp

    saved = set(_saved_keys(path))
    state = checkpoint_state(model, optimizer)
    missing = _missing_optimizer_keys(state, saved)
    if missing:
        raise UserError(f"checkpoint {path}: its optimizer state does not fit this run (missing {missing[:3]})")
    made = []
    for s in optimizer.slots:
        entry, key = state["optimizer"]["params"][s.name], f"optimizer.params.{s.name}.master"
        if "master" in entry and key not in saved:  # saved without master weights: made from the loaded weights
            del entry["master"]
            made.append(s.name)
        elif "master" not in entry and key in saved:  # saved with them, resumed without: keep their precision
            entry["master"] = state["model"][s.name]
    dcp.load(state, storage_reader=_reader(path))
    optimizer.step_count = int(state["optimizer"]["step"])
    optimizer.sync_from_masters(made_from_params=made)


def scatter_full(full: dict, model, optimizer) -> None:
    """A whole (format-2) state into a sharded model and optimizer: each rank copies its part of each tensor out
    of the memory-mapped whole; nothing is communicated."""
    targets = checkpoint_state(model, optimizer)
    for name, t in targets["model"].items():
        _copy_part(t, full["model"][name])
    saved = full["optimizer"]["params"]
    names = {s.name for s in optimizer.slots}
    elsewhere = getattr(model, "keys_elsewhere", set())  # a pipeline rank's: held by the other ranks
    if names - set(saved) or set(saved) - names - elsewhere:
        missing, extra = sorted(names - set(saved))[:3], sorted(set(saved) - names - elsewhere)[:3]
        raise ValueError(f"optimizer state does not match the model: missing {missing}, unexpected {extra}")
    made = []
    for s in optimizer.slots:
        entry, mine = saved[s.name], targets["optimizer"]["params"][s.name]
        _copy_part(mine["exp_avg"], entry["exp_avg"])
        _copy_part(mine["exp_avg_sq"], entry["exp_avg_sq"])
        if "master" in mine and "master" in entry:
            _copy_part(mine["master"], entry["master"])
        elif "master" in mine:
            made.append(s.name)
        elif "master" in entry:
            _copy_part(targets["model"][s.name], entry["master"])
    optimizer.step_count = int(full["optimizer"]["step"])
    optimizer.sync_from_masters(made_from_params=made)


def _copy_part(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy the part of ``whole`` that ``target`` holds (its local shard for a DTensor, all of it otherwise)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        target.copy_(whole)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(whole.shape) != tuple(target.shape):
        raise ValueError(f"a saved tensor is {list(whole.shape)}, this run's is {list(target.shape)}")
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    part = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    target.to_local().copy_(part)
