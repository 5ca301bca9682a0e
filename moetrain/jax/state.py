"""The JAX model as flat, named arrays: what the jitted step functions take and return.

``ModelState.of(model)`` splits an NNX model into its graph definition and two dicts keyed by torch's dotted names:
``params`` (trained) and ``buffers`` (the expert biases and load counts). ``ModelState.merge(params, buffers)``
rebuilds the module inside a traced function. Flat dicts keep the optimizer state, checkpoints and the
torch-side names one mapping apart (none at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from moetrain.jax.model import Buffer


def _flat(state) -> tuple[dict[str, jax.Array], dict[str, tuple]]:
    values, paths = {}, {}
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        values[name], paths[name] = var[...], path
    return values, paths


def _unflat(values: dict, paths: dict, kind) -> nnx.State:
    return nnx.from_flat_state([(paths[name], kind(value)) for name, value in values.items()])


@dataclass
class ModelState:
    graphdef: object
    params: dict[str, jax.Array]
    buffers: dict[str, jax.Array]
    param_paths: dict[str, tuple]
    buffer_paths: dict[str, tuple]

    @classmethod
    def of(cls, model: nnx.Module) -> "ModelState":
        graphdef, params, buffers = nnx.split(model, nnx.Param, Buffer)
        p, p_paths = _flat(params)
        b, b_paths = _flat(buffers)
        return cls(graphdef, p, b, p_paths, b_paths)

    def merge(self, params: dict, buffers: dict) -> nnx.Module:
        return nnx.merge(self.graphdef, _unflat(params, self.param_paths, nnx.Param),
                         _unflat(buffers, self.buffer_paths, Buffer))

    def buffers_of(self, model: nnx.Module) -> dict[str, jax.Array]:
        return _flat(nnx.state(model, Buffer))[0]


def cast(tree: dict, dtype) -> dict:
    """Floating arrays of a flat dict in ``dtype`` (a no-op where they already are)."""
    return {k: v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) and v.dtype != dtype else v
            for k, v in tree.items()}
