"""Properties of a CUDA device, asked once per device: the launchers and the run-time caches ask on every
call (a GPU's name keys auto's choices and the tuned configs; SM count and compute capability size and
gate the kernels). Plain torch (no triton)."""

from __future__ import annotations

import contextlib

import torch

_PROPS: dict = {}  # device index -> torch.cuda device properties


def _props(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROPS:
        _PROPS[index] = torch.cuda.get_device_properties(index)
    return _PROPS[index]


def device_name(device: torch.device) -> str:
    """The GPU's name, as torch.cuda.get_device_name gives it."""
    return _props(device).name


def sm_count(device: torch.device) -> int:
    return _props(device).multi_processor_count


def capability_major(device: torch.device) -> int:
    return _props(device).major


def on_device(device: torch.device):
    """The context a Triton launch on ``device``'s tensors runs in: Triton launches on the current CUDA device, so
    that must be the tensors' one. Already current (the usual case), no device switch in and out: ~20 launches per
    MoE layer call pass here. CPU tensors (the interpreter): nothing."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
