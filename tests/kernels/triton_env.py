"""Shared setup of the kernel test modules: on a machine without CUDA, run Triton in its CPU
interpreter (TRITON_INTERPRET=1 must be set before triton is first imported), or skip the
module when that is no longer possible or triton is missing. Import it before triton."""

import os
import sys

import pytest
import torch


def use_gpu_or_interpreter() -> bool:
    """True on a CUDA machine; otherwise switch Triton to the interpreter (or skip the module)."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
            pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton", reason="the triton package is not installed")
    return on_gpu
