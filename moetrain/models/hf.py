"""Hugging Face interop: build a moetrain model from a HF checkpoint, load its weights, export.

Public API (all CPU-friendly; torch is imported by this module, not by ``moetrain``):
* ``config_from_hf(path, mtp=None) -> Config``: schema defaults + the architecture from
  ``path/config.json`` (+ soft hints: name, init_std, aux loss) + ``model.from_hf = path``.
* ``from_hf(path, dtype=torch.float32) -> MoETransformer`` (eval mode): ``model(input_ids)``
  gives logits [B, S, V]. Built on the meta device and filled straight from the files.
  Quantized checkpoints are dequantized on import: GPT-OSS MXFP4 experts (mxfp4.py) and
  block-scaled FP8 weights with ``*_scale_inv`` siblings (the released DeepSeek-V3).
* ``load_hf_weights(model, path)``: fill an existing model (any device/dtype) in place.
* ``export_hf(model_or_state_dict, cfg, out_dir)``: config.json + safetensors in the family's
  HF naming (sharded with an index when larger than ``max_shard_size``). A state dict may use the
  names of earlier moetrain versions (legacy.py), as may a moetrain model directory being loaded.
* ``save_moetrain_dir`` / moetrain model directories: ``config.yaml`` (the full resolved config)
  + ``model.safetensors`` (moetrain names; sharded + index when large) + ``hf_config.json`` and
  ``hf_files/`` (the original config and tokenizer files, used again on export).

``path`` may be a HF checkpoint directory or a moetrain model directory (config.yaml, no
config.json). MTP (DeepSeek-V3): ``mtp=None`` keeps the depths whose weights exist, False drops
them, True requires them. See hf_config.py (config mapping) and hf_families.py (tensor layout).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from moetrain.config.schema import Config
from moetrain.errors import UserError
from moetrain.models.hf_config import (
    DEEPSEEK, MOETRAIN_CONFIG, arch_from_hf, cfg_arch, effective_arch, hf_config_from_cfg, hints_from_hf,
    infer_model_type, is_moetrain_dir, model_type_of, read_hf_config)
from moetrain.models.hf_files import CheckpointFiles, mtp_layers_present
from moetrain.models.hf_families import ignorable, layout
from moetrain.models.hf_io import (
    DEFAULT_SHARD_SIZE, check_coverage, identity_pieces, load_pieces, moetrain_dir_pieces, state_targets, write_pieces)
from moetrain.models.legacy import upgrade_state_dict

HF_CONFIG_COPY = "hf_config.json"
HF_FILES_DIR = "hf_files"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        section, name = key.split(".")
        out.setdefault(section, {})[name] = value
    return out


def _moetrain_cfg(path: Path) -> Config:
    """The config.yaml of a moetrain model directory, without resolving its own model.from_hf."""
    from moetrain.config.load import build, resolve

    return build(resolve(path=str(path / MOETRAIN_CONFIG)))


def config_from_hf(path: str | Path, *, mtp: Optional[bool] = None) -> Config:
    """A Config whose model.*/moe.* architecture is the checkpoint's (other keys: schema defaults)."""
    from moetrain.config.load import ResolvedConfig, build

    p = Path(path)
    if is_moetrain_dir(p):
        cfg = _moetrain_cfg(p)
        if mtp is False:
            cfg.model.mtp_num_layers = 0
        cfg.model.from_hf = str(p)
        return cfg
    hf = read_hf_config(p)
    label = str(p / "config.json")
    mt = model_type_of(hf, label)
    present = None
    if mt == "deepseek_v3":
        present = mtp_layers_present(CheckpointFiles(p), hf)
        wanted = hf.get("num_nextn_predict_layers") or 0
        if mtp and present < max(wanted, 1):
            raise UserError(f"{p}: MTP weights requested but the checkpoint has {present} of "
                            f"{wanted} MTP layer(s) (model.layers.{hf['num_hidden_layers']}.eh_proj.weight, ...)")
    elif mtp:
        raise UserError(f"{p}: MTP weights requested but {mt} checkpoints have none")
    arch = arch_from_hf(hf, mtp_layers=0 if mtp is False else present, where=label)
    resolved = ResolvedConfig()
    resolved.apply(_nested(arch), label)
    resolved.apply(_nested(hints_from_hf(hf, p.resolve().name)), label)
    resolved.apply({"model": {"from_hf": str(p)}}, "config_from_hf")
    return build(resolved)


def _check_arch(cfg: Config, source: dict, label: str) -> None:
    want, got = effective_arch(cfg_arch(cfg)), effective_arch(source)
    m_want, m_got = want.pop("model.mtp_num_layers"), got.pop("model.mtp_num_layers")
    if m_want > m_got:
        raise UserError(f"model.mtp_num_layers = {m_want} but {label} has weights for {m_got} MTP depth(s)")
    bad = [k for k in want if want[k] != got[k]]
    if bad:
        listed = "; ".join(f"{k} = {want[k]!r} in the model, {got[k]!r} in the checkpoint" for k in bad)
        raise UserError(f"the model does not match {label}: {listed}")


def load_hf_weights(model, path: str | Path, *, progress: bool = False) -> None:
    """Fill ``model`` (a MoETransformer; any device and dtype) in place from a HF checkpoint
    directory or a moetrain model directory. UserError when the architecture differs or a tensor
    is missing, unexpected or misshaped (each named)."""
    cfg = model.cfg
    p = Path(path)
    targets = state_targets(model)
    if is_moetrain_dir(p):
        _check_arch(cfg, cfg_arch(_moetrain_cfg(p)), str(p / MOETRAIN_CONFIG))
        files = CheckpointFiles(p)
        keep = cfg.model.mtp_num_layers

        pieces = moetrain_dir_pieces(targets, files)
        read = {n for piece in pieces for n in piece.hf}

        def skip(name: str) -> bool:  # MTP depths past the model's, and a pipeline stage's other stages' tensors
            past_depths = name.startswith("mtp.") and int(name.split(".")[1]) >= keep
            return past_depths or (model.is_stage and name not in read)

        load_pieces(targets, pieces, files, skip=skip, progress=progress)
        return
    hf = read_hf_config(p)
    label = str(p / "config.json")
    mt = model_type_of(hf, label)
    files = CheckpointFiles(p)
    present = mtp_layers_present(files, hf) if mt == "deepseek_v3" else None
    _check_arch(cfg, arch_from_hf(hf, mtp_layers=present, where=label), label)
    pieces = layout(cfg, mt, hf, keys=set(files.names()))
    elsewhere: set[str] = set()
    if model.is_stage:  # a pipeline stage reads its own tensors; the others' are expected in the files, not read
        pieces, elsewhere = stage_pieces(pieces, targets)
    check_coverage(pieces, targets, f"{mt} import")

    def skip(name: str) -> bool:
        return (ignorable(cfg, mt, hf, name) or (cfg.model.tie_embeddings and name == "lm_head.weight")
                or name in elsewhere)

    load_pieces(targets, pieces, files, skip=skip, progress=progress, fp8_block=_fp8_block(hf))


def stage_pieces(pieces: list, targets: dict) -> tuple[list, set[str]]:
    """(the pieces that fill a pipeline stage's ``targets``, the HF names that only the other stages' pieces read)."""
    def mine(piece) -> bool:
        name = piece.ours if piece.ours is not None else piece.copy_of
        return name.startswith("zeros:") or name in targets

    keep = [piece for piece in pieces if mine(piece)]
    read = {n for piece in keep for n in piece.hf}
    return keep, {n for piece in pieces if not mine(piece) for n in piece.hf} - read


def _fp8_block(hf: dict) -> Optional[tuple[int, int]]:
    """Block size of a block-scaled FP8 checkpoint (released DeepSeek-V3), else None."""
    q = hf.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def from_hf(path: str | Path, dtype: torch.dtype = torch.float32, *, mtp: Optional[bool] = None,
            device: str | torch.device = "cpu", progress: bool = False):
    """A MoETransformer (eval mode) with the checkpoint's architecture and weights."""
    from moetrain.models import build_model

    cfg = config_from_hf(path, mtp=mtp)
    model = build_model(cfg, device="meta")
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_moe_stats()  # the only non-persistent buffers: zero them
    load_hf_weights(model, path, progress=progress)
    return model.eval()


# ---- export -----------------------------------------------------------------------------------

def checkpoint_dtype(hf: dict) -> torch.dtype:
    """The dtype a HF checkpoint's weights are stored in (MXFP4 experts -> bf16)."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if (hf.get("quantization_config") or {}).get("quant_method") in ("mxfp4", "fp8"):
        name = "bfloat16"
    if name not in DTYPES:
        raise UserError(f"config.json dtype {name!r} is not supported (float32, bfloat16, float16)")
    return DTYPES[name]


def export_hf(model, cfg: Config, out_dir: str | Path, *, model_type: Optional[str] = None,
              base_config: Optional[dict] = None, dtype: Optional[torch.dtype] = None,
              max_shard_size: int | str = DEFAULT_SHARD_SIZE, drop_mtp: bool = False,
              progress: bool = False) -> Path:
    """Write ``out_dir/config.json`` + safetensors in HF naming for ``model`` (a MoETransformer
    or its state dict). ``model_type``: the family (default: base_config's, else inferred from
    cfg); ``base_config``: the original config.json whose extra keys are kept; ``dtype``: output
    dtype of the floating tensors (default: as stored; DeepSeek's expert bias stays fp32)."""
    tensors = upgrade_state_dict(model) if isinstance(model, dict) else state_targets(model)
    if model_type is None:
        model_type = model_type_of(base_config, "base config") if base_config else infer_model_type(cfg)
    if dtype is None:
        dtype = tensors["embed.weight"].dtype
    hf = hf_config_from_cfg(cfg, model_type, base_config, dtype=DTYPE_NAMES.get(dtype, "float32"), drop_mtp=drop_mtp)
    if drop_mtp:
        cfg = copy.deepcopy(cfg)
        cfg.model.mtp_num_layers = 0
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    pieces = layout(cfg, model_type, hf)
    check_coverage(pieces, tensors, f"{model_type} export")

    def dtype_of(name: str, t: torch.Tensor) -> torch.dtype:
        if name.endswith("e_score_correction_bias"):
            return torch.float32  # HF keeps it fp32 (selection-only bias, updates of 1e-3)
        return dtype if t.is_floating_point() else t.dtype

    out = Path(out_dir)
    write_pieces(out, pieces, tensors, dtype_of=dtype_of, max_shard_size=max_shard_size, progress=progress)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out


def save_moetrain_dir(model, cfg: Config, out_dir: str | Path, *, hf_config: Optional[dict] = None,
                      hf_files_from: Optional[str | Path] = None, dtype: Optional[torch.dtype] = None,
                      max_shard_size: int | str = DEFAULT_SHARD_SIZE, progress: bool = False) -> Path:
    """A moetrain model directory: config.yaml + model.safetensors (moetrain names) [+ the
    original HF config.json as hf_config.json and its tokenizer files under hf_files/]."""
    from moetrain.config.load import dump_config

    tensors = upgrade_state_dict(model) if isinstance(model, dict) else state_targets(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def dtype_of(name: str, t: torch.Tensor) -> torch.dtype:
        if dtype is None or not t.is_floating_point() or name.endswith("router.expert_bias"):
            return t.dtype
        return dtype

    write_pieces(out, identity_pieces(tensors), tensors, dtype_of=dtype_of, max_shard_size=max_shard_size,
                 progress=progress)
    cfg = copy.deepcopy(cfg)
    cfg.model.from_hf = None  # the weights are here
    (out / MOETRAIN_CONFIG).write_text(dump_config(cfg))
    if hf_config is not None:
        (out / HF_CONFIG_COPY).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if hf_files_from is not None:
        copy_side_files(hf_files_from, out / HF_FILES_DIR)
    return out


SIDE_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken", ".py")
NOT_SIDE = {"config.json", "model.safetensors.index.json", HF_CONFIG_COPY}


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer / generation files (small non-weight files) from src to dst."""
    src, dst = Path(src), Path(dst)
    copied = []
    if not src.is_dir():
        return copied
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in SIDE_SUFFIXES and f.name not in NOT_SIDE and f.stat().st_size < 2**28:
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst / f.name)
            copied.append(f.name)
    return copied


__all__ = ["DEEPSEEK", "checkpoint_dtype", "config_from_hf", "export_hf", "from_hf", "load_hf_weights",
           "save_moetrain_dir"]
