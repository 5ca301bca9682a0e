"""runtime.cuda_device.on_device: the context our Triton launchers enter (no GPU needed)."""

import contextlib

import torch

from moetrain.runtime import cuda_device


def test_on_device_switches_only_to_another_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # CPU tensors (the interpreter), an unindexed "cuda" and the current GPU: no switch in and out
    for device in (torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 0)):
        assert isinstance(cuda_device.on_device(device), contextlib.nullcontext), device
    other = cuda_device.on_device(torch.device("cuda", 1))
    assert isinstance(other, torch.cuda.device) and other.idx == 1
