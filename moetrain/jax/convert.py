"""Weights between the torch ``MoETransformer`` and the JAX one: the same names, shapes and layouts.

A torch state dict's key is the dotted path of the NNX variable (``layers.1.mlp.experts.w1``); both sides keep
torch's [out, in] Linear weights and the stacked expert weights, so a tensor moves as it is. The persistent
state is the parameters plus the routers' ``expert_bias``; the load counters (``tokens_per_expert``) are not
part of it on either side. A name on one side and not the other, or a shape that differs, is one error naming
them all.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

NOT_PERSISTENT = ("tokens_per_expert",)


def persistent_name(name: str) -> bool:
    """Whether a dotted name is part of the persistent state (not a load counter)."""
    return name.rsplit(".", 1)[-1] not in NOT_PERSISTENT


def named_arrays(model: nnx.Module) -> dict[str, nnx.Variable]:
    """Dotted torch name -> the model's variable, for the persistent state (parameters and expert biases)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Variable))
    named = {".".join(str(p) for p in path): var for path, var in flat}
    return {name: var for name, var in named.items() if persistent_name(name)}


def state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's persistent state as numpy arrays under torch's names (fp32 for bf16, which numpy lacks)."""
    out = {}
    for name, var in named_arrays(model).items():
        value = var.get_value()
        out[name] = np.asarray(value.astype(jnp.float32) if value.dtype == jnp.bfloat16 else value)
    return out


def _check_names(have: dict, given: dict) -> None:
    missing = sorted(set(have) - set(given))
    unexpected = sorted(set(given) - set(have))
    bad_shape = sorted(f"{k} {tuple(given[k].shape)} vs {tuple(have[k].get_value().shape)}"
                       for k in set(have) & set(given) if tuple(given[k].shape) != tuple(have[k].get_value().shape))
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if unexpected:
        problems.append(f"unexpected {unexpected}")
    if bad_shape:
        problems.append(f"shape differs (given vs model): {bad_shape}")
    if problems:
        raise ValueError("load_state_dict: the weights do not fit this model: " + "; ".join(problems))


def load_state_dict(model: nnx.Module, weights: dict) -> None:
    """Set the model's persistent state from ``weights`` (name -> numpy array or torch tensor), each cast to the
    variable's dtype. Every name must match (``_check_names``)."""
    have = named_arrays(model)
    arrays = {k: to_numpy(v) for k, v in weights.items()}
    _check_names(have, arrays)
    for name, var in have.items():
        var.set_value(jnp.asarray(arrays[name], dtype=var.get_value().dtype))


def to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor (bf16 goes through fp32: numpy has no bf16)
        t = value.detach().cpu()
        return (t.float() if t.dtype.is_floating_point and t.element_size() == 2 else t).numpy()
    return np.asarray(value)


def from_torch(torch_model, model: nnx.Module) -> None:
    """Copy a torch MoETransformer's weights (its state_dict) into the JAX ``model``."""
    load_state_dict(model, torch_model.state_dict())


def to_torch(model: nnx.Module, torch_model) -> None:
    """Copy the JAX model's weights into a torch MoETransformer (strict: every name must match)."""
    import torch

    sd = {k: torch.from_numpy(np.array(v)) for k, v in state_dict(model).items()}
    dtypes = {k: v.dtype for k, v in torch_model.state_dict().items()}
    torch_model.load_state_dict({k: v.to(dtypes.get(k, v.dtype)) for k, v in sd.items()}, strict=True)
