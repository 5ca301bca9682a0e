"""Whether optional packages are importable, asked without importing them (plain Python)."""

from __future__ import annotations

import importlib.util
import sys


def triton_available() -> bool:
    """Whether the triton package can be imported. Asked on every MoE layer call: a triton already imported answers
    without find_spec's search of sys.path."""
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None
