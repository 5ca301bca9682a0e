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
