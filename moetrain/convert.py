"""`moetrain convert`: Hugging Face checkpoints <-> moetrain model directories.

* ``hf-to-moetrain --hf-dir DIR --out OUT``: OUT/config.yaml (the full resolved config, the
  architecture from DIR/config.json) + OUT/model.safetensors (moetrain parameter names;
  sharded with an index when large) + OUT/hf_config.json and OUT/hf_files/ (the original
  config and tokenizer files, reused by the way back). Train from it with
  ``moetrain train --config OUT/config.yaml model.from_hf=OUT``.
* ``moetrain-to-hf --ckpt SRC --out OUT``: SRC is such a directory, a trainer checkpoint
  (``<out_dir>/checkpoints/step_N`` with model.pt + config.yaml) or a training out_dir (its
  latest checkpoint) -> OUT/config.json + safetensors in the family's HF naming, plus the
  tokenizer files when known (hf_files/, or the model.from_hf directory of the training run).

Both write into a temporary sibling of OUT and move the result into place only when every
file is written: a failure (full disk, read-only directory, Ctrl-C) leaves no partial output,
and files that were in OUT before (``--force``) are untouched unless a complete new output
replaces them (files of the same name, and the previous weight files). OS failures are
one-line UserErrors (``errors.os_error``).

``register(commands, add_config_source)`` adds the subcommands to the CLI's argparse
subparsers; torch is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from moetrain.errors import UserError, os_error

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
FAMILY_CHOICES = ("auto", "deepseek_v2", "deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss")


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out}: directory is not empty (use --force to write into it)")


def _missing_parents(path: Path) -> list[Path]:
    """The directories above ``path`` that do not exist yet, deepest first."""
    missing = []
    for parent in path.absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def _shown(err: OSError, tmp: Path, out: Path) -> OSError:
    """``err`` with a path inside the temporary directory shown as the path it was meant for."""
    name = err.filename
    if name is not None and Path(name).absolute().is_relative_to(tmp.absolute()):
        name = str(out / Path(name).absolute().relative_to(tmp.absolute()))
    return OSError(err.errno, err.strerror, name)


def _move_into(tmp: Path, out: Path) -> None:
    """Put the complete output ``tmp`` at ``out``: a rename when ``out`` is absent or empty, else
    file by file (replacing same-named files and the previous weight files, keeping the rest)."""
    from moetrain.models.hf_io import weight_files

    if not out.exists() or not any(out.iterdir()):
        os.replace(tmp, out)  # POSIX rename replaces an empty directory
        return
    new = sorted(p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file())
    for stale in weight_files(out):
        if stale.relative_to(out) not in new:
            stale.unlink()
    for rel in new:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / rel, out / rel)
    shutil.rmtree(tmp)


@contextmanager
def _staged(out: Path):
    """Yields a new temporary directory beside ``out`` to write the output into, moved into place
    on success. On failure it is removed with the parent directories made for it, and an OSError
    becomes a one-line UserError (disk full with the bytes needed, read-only, ...)."""
    after = f"{out} is unchanged" if out.exists() else "nothing was written"
    made = _missing_parents(out)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()  # mode 0o777 & ~umask, as `out` itself would get
    except OSError as err:
        _remove_dirs(made)
        raise os_error(OSError(err.errno, err.strerror, str(out.parent)), f"writing {out}", after=after) from None
    try:
        yield tmp
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(made)
        if isinstance(exc, OSError):
            raise os_error(_shown(exc, tmp, out), f"writing {out}", needed_bytes=getattr(exc, "needed_bytes", None),
                           after=after) from None
        raise
    try:
        _move_into(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise os_error(_shown(err, tmp, out), f"moving the written output into {out}") from None


def _remove_dirs(dirs: list[Path]) -> None:
    for d in dirs:  # deepest first; only those still empty
        try:
            d.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            break


def _dtype(name: str, default):
    from moetrain.models.hf import DTYPES

    return default if name == "auto" else DTYPES[name]


def hf_to_moetrain(hf_dir: str | Path, out: str | Path, *, dtype: str = "auto", drop_mtp: bool = False,
                   max_shard_size: str = "5GB", force: bool = False, progress: bool = False) -> Path:
    """Convert a HF checkpoint directory into a moetrain model directory; returns ``out``."""
    from moetrain.models.hf import checkpoint_dtype, from_hf, read_hf_config, save_moetrain_dir
    from moetrain.models.hf_config import is_moetrain_dir

    src, out = Path(hf_dir), Path(out)
    if is_moetrain_dir(src):
        raise UserError(f"--hf-dir {src}: this is already a moetrain model directory")
    hf = read_hf_config(src)
    _check_out(out, force)
    torch_dtype = _dtype(dtype, checkpoint_dtype(hf))
    model = from_hf(src, torch_dtype, mtp=False if drop_mtp else None, progress=progress)
    with _staged(out) as tmp:
        save_moetrain_dir(model, model.cfg, tmp, hf_config=hf, hf_files_from=src, max_shard_size=max_shard_size,
                          progress=progress)
    return out


def _trainer_checkpoint(src: Path) -> Path | None:
    """A trainer checkpoint directory for SRC (itself, or the latest under SRC/checkpoints)."""
    from moetrain.train import checkpoint as ckpt

    if (src / "model.pt").is_file():
        reason = ckpt.verify(src, only=("model.pt", "config.yaml"))
        if reason is not None:
            raise UserError(f"--ckpt {src}: {reason}")
        return src
    found = ckpt.list_checkpoints(src)
    for path in reversed(found):
        reason = ckpt.verify(path, only=("model.pt", "config.yaml"))
        if reason is None:
            return path
        print(f"warning: skipping damaged checkpoint {path}: {reason}", file=sys.stderr)
    if found:
        raise UserError(f"--ckpt {src}: none of its {len(found)} checkpoint(s) is intact")
    return None


def _not_a_ckpt_dir(src: Path) -> str:
    """'--ckpt SRC: no such directory', suggesting the one training out_dir beside it, if one."""
    from moetrain.train import checkpoint as ckpt

    message = f"--ckpt {src}: " + ("not a directory" if src.exists() else "no such directory")
    parent = src.parent
    runs = [d.name for d in sorted(parent.iterdir()) if d.is_dir() and ckpt.list_checkpoints(d)] \
        if parent.is_dir() else []
    if len(runs) == 1:
        message += f"; did you mean {parent / runs[0]}?"
    return message


def moetrain_to_hf(ckpt: str | Path, out: str | Path, *, family: str = "auto", dtype: str = "auto",
                   drop_mtp: bool = False, max_shard_size: str = "5GB", force: bool = False,
                   progress: bool = False) -> Path:
    """Convert a moetrain model directory or trainer checkpoint into a HF checkpoint; returns ``out``."""
    import json
    import pickle

    import torch

    from moetrain.train.checkpoint import first_non_finite

    from moetrain.config.load import build, resolve
    from moetrain.models.hf import HF_CONFIG_COPY, HF_FILES_DIR, copy_side_files, export_hf
    from moetrain.models.hf_config import is_moetrain_dir
    from moetrain.models.hf_files import CheckpointFiles
    from moetrain.models.hf_io import read_all

    src, out = Path(ckpt), Path(out)
    if not src.is_dir():
        raise UserError(_not_a_ckpt_dir(src))
    base, side = None, None
    trainer_ckpt = _trainer_checkpoint(src)
    if trainer_ckpt is not None:
        # The checkpoint's own config, without resolving model.from_hf again (the HF directory it
        # names may be gone; it only serves as the base config.json and tokenizer source).
        cfg = build(resolve(path=str(trainer_ckpt / "config.yaml")))
        try:
            state = torch.load(trainer_ckpt / "model.pt", map_location="cpu", weights_only=True, mmap=True)
        except (OSError, RuntimeError, pickle.UnpicklingError) as err:
            raise UserError(f"{trainer_ckpt / 'model.pt'}: cannot read ({str(err).splitlines()[0]})") from None
        bad = first_non_finite(state)
        if bad is not None:
            raise UserError(f"{trainer_ckpt / 'model.pt'}: holds non-finite values (NaN or inf) in {bad}; "
                            "export an earlier checkpoint")
        origin = Path(cfg.model.from_hf) if cfg.model.from_hf else None
        if origin is not None and (origin / "config.json").is_file():
            base, side = json.loads((origin / "config.json").read_text()), origin
        elif origin is not None and (origin / HF_CONFIG_COPY).is_file():
            base, side = json.loads((origin / HF_CONFIG_COPY).read_text()), origin / HF_FILES_DIR
    elif is_moetrain_dir(src):
        cfg = build(resolve(path=str(src / "config.yaml")))
        state = read_all(CheckpointFiles(src))
        if (src / HF_CONFIG_COPY).is_file():
            base, side = json.loads((src / HF_CONFIG_COPY).read_text()), src / HF_FILES_DIR
    else:
        raise UserError(f"--ckpt {src}: neither a moetrain model directory (config.yaml + model.safetensors) "
                        "nor a trainer checkpoint (model.pt + config.yaml) nor a training out_dir with checkpoints")
    _check_out(out, force)
    with _staged(out) as tmp:
        export_hf(state, cfg, tmp, model_type=None if family == "auto" else family, base_config=base,
                  dtype=_dtype(dtype, None), max_shard_size=max_shard_size, drop_mtp=drop_mtp, progress=progress)
        if side is not None:
            copy_side_files(side, tmp)
    return out


# ---- CLI ----------------------------------------------------------------------------------------

def cmd_hf_to_moetrain(args: argparse.Namespace) -> int:
    out = hf_to_moetrain(args.hf_dir, args.out, dtype=args.dtype, drop_mtp=args.drop_mtp,
                         max_shard_size=args.max_shard_size, force=args.force, progress=sys.stderr.isatty())
    print(f"wrote {out} (train from it: moetrain train --config {out / 'config.yaml'} model.from_hf={out})")
    return 0


def cmd_moetrain_to_hf(args: argparse.Namespace) -> int:
    out = moetrain_to_hf(args.ckpt, args.out, family=args.family, dtype=args.dtype, drop_mtp=args.drop_mtp,
                         max_shard_size=args.max_shard_size, force=args.force, progress=sys.stderr.isatty())
    print(f"wrote {out}")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="dtype of the written weights (auto: as stored; MXFP4 experts become bf16)")
    p.add_argument("--drop-mtp", action="store_true", help="leave out the multi-token-prediction weights")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors file, e.g. 5GB or 500MiB (default 5GB)")
    p.add_argument("--force", action="store_true", help="write into a non-empty output directory")


def register(commands, add_config_source=None) -> None:
    """Add `convert hf-to-moetrain | moetrain-to-hf` to the CLI's argparse subparsers ``commands``.
    (``add_config_source`` is accepted for symmetry with the other commands; convert reads its
    configuration from the checkpoints themselves.)"""
    convert = commands.add_parser("convert", help="convert checkpoints between Hugging Face and moetrain").add_subparsers(
        dest="subcommand", metavar="SUBCOMMAND", required=True)
    p = convert.add_parser("hf-to-moetrain", help="a HF checkpoint directory -> a moetrain model directory")
    p.add_argument("--hf-dir", required=True, metavar="DIR", help="HF directory: config.json + *.safetensors")
    _common(p)
    p.set_defaults(func=cmd_hf_to_moetrain)
    p = convert.add_parser("moetrain-to-hf", help="a moetrain model directory or trainer checkpoint -> HF")
    p.add_argument("--ckpt", required=True, metavar="DIR",
                   help="moetrain model directory, trainer checkpoint (step_N) or training out_dir (latest)")
    p.add_argument("--family", choices=FAMILY_CHOICES, default="auto",
                   help="HF model_type to write (auto: the original checkpoint's, else inferred)")
    _common(p)
    p.set_defaults(func=cmd_moetrain_to_hf)
