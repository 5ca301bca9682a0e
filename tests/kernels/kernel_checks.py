"""Shared by the kernel test modules (plain torch: safe to import before triton): the relative error against a
float64 reference, with the NaN check that catches outputs a kernel never wrote (they are poisoned first), and
a fresh Python process without the interpreter (for compiled-kernel checks from a process that set it)."""

import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FP32_BOUND = 1e-5  # fp32 accumulation over <= 100 terms, compared with fp64


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 on the CPU; fails on NaN (an unwritten, poisoned element)."""
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) or NaN outputs"
    want = want.double().cpu()
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()


def run_without_interpreter(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -c code`` with the repository importable and TRITON_INTERPRET unset (a process that set it
    cannot load compiled kernels); stdout and stderr captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
