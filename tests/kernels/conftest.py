"""Fixtures shared by the kernel tests."""

import pytest


@pytest.fixture
def exact_fp32():
    """fp32 matmuls in IEEE precision for the test: on a GPU, fp32 dots (torch's and our kernels')
    follow torch's matmul precision, and the tests' bounds are fp32's, not TF32's."""
    import torch

    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty filled with NaN (floats) or -7 (integers) for the test: an output element a kernel never wrote
    shows, instead of passing on whatever the memory held (often 0, a valid value for many outputs)."""
    import torch

    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", empty)
