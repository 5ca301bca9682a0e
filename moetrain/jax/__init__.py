"""The JAX backend: the same model families as the torch side (Qwen3-MoE, Mixtral, DeepSeek-V2/V3 with MLA, GPT-OSS),
built from the same ``Config`` in Flax NNX, with weights that interchange with the torch model by name.

JAX is an optional extra (``pip install -e ".[jax]"``). Nothing here imports jax at import time of ``moetrain``:
``require_jax()`` is the one gate, and says how to install it when it is missing.

Modules: ``ops`` (norm, RoPE, attention core, activations, cross-entropy), ``routing`` (top-k routing and the
balancing losses), ``grouped_gemm`` (the expert GEMM with its custom VJP), ``moe`` (sync-free dispatch -> experts ->
combine under jit), ``model`` (the NNX modules), ``convert`` (torch state dict <-> NNX state).
"""

from __future__ import annotations

import importlib.util

from moetrain.errors import UserError

INSTALL_HINT = 'pip install -e ".[jax]"  (jax, flax, optax, orbax-checkpoint)'


def require_jax() -> None:
    """Raise a one-line UserError naming the install command when jax or flax is missing."""
    missing = [name for name in ("jax", "flax", "optax") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"the JAX backend needs {', '.join(missing)}, which is not installed: {INSTALL_HINT}")
