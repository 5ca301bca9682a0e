"""AdamW for the JAX trainer: optax's Adam moments and decoupled weight decay, the torch trainer's semantics.

The update is the torch ``PrecisionAwareAdamW``'s: with g the (clipped) gradient,
m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, p -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd p),
weight decay on matrices only (``train.optim.decays``) unless optim.decay_norms_biases_embeddings. Clipping scales
the gradients by clip / (norm + 1e-6) where the global norm exceeds optim.clip_grad, as the torch trainer does.

Precision: the optimizer updates ``params`` — fp32 masters when the model computes in bf16 with
precision.master_weights, else the parameters themselves; the first moment is kept in optim.exp_avg_dtype (optax's
mu_dtype) and the second in the updated arrays' dtype. A configuration whose second moment would need another dtype
is refused (``check_precision``).

``state_dict(opt_state, params, masters)`` and ``load_state_dict`` use the torch optimizer's checkpoint layout
({"step", "params": {name: {"exp_avg", "exp_avg_sq"[, "master"]}}}, torch tensors), so a checkpoint of either
backend resumes in the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu

from moetrain.errors import UserError
from moetrain.jax.convert import to_numpy
from moetrain.train.optim import decays

JNP_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


def check_precision(optim, updated_dtype) -> None:
    """Refuse moment dtypes this optimizer does not keep (the second moment lives in the updated arrays' dtype)."""
    want = JNP_DTYPES[optim.exp_avg_sq_dtype]
    if want != updated_dtype:
        raise UserError(f"optim.exp_avg_sq_dtype = {optim.exp_avg_sq_dtype}: the JAX backend keeps the second "
                        f"moment in the dtype of the weights it updates ({jnp.dtype(updated_dtype).name} here); "
                        "set it to match, or train with train.backend=torch")


def decay_mask(params: dict, optim) -> dict:
    return {name: optim.decay_norms_biases_embeddings or decays(name, value.ndim) for name, value in params.items()}


def make(params: dict, optim) -> optax.GradientTransformation:
    """Adam moments then decoupled weight decay; the caller scales by -lr (the lr is a traced argument)."""
    parts = [optax.scale_by_adam(b1=optim.beta1, b2=optim.beta2, eps=optim.eps,
                                 mu_dtype=JNP_DTYPES[optim.exp_avg_dtype])]
    if optim.weight_decay > 0:
        parts.append(optax.add_decayed_weights(optim.weight_decay, mask=decay_mask(params, optim)))
    return optax.chain(*parts)


def global_norm(grads: dict) -> jax.Array:
    """fp32 L2 norm over every gradient."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values()))


def apply(tx, params: dict, opt_state, grads: dict, lr: jax.Array, clip: float):
    """(new params, new optimizer state, the gradient norm before clipping, whether the update applies): no update
    where the norm is not finite (the caller also withholds it for a non-finite loss)."""
    norm = global_norm(grads)
    scale = jnp.where((clip > 0) & (norm > clip), clip / (norm + 1e-6), 1.0) if clip > 0 else 1.0
    grads = {k: (g.astype(jnp.float32) * scale).astype(params[k].dtype) for k, g in grads.items()}
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = {k: (p.astype(jnp.float32) - lr * updates[k].astype(jnp.float32)).astype(p.dtype)
                  for k, p in params.items()}
    return new_params, new_state, norm


def state_dict(opt_state, params: dict, has_masters: bool) -> dict:
    """The torch optimizer checkpoint layout, torch tensors on the CPU."""
    mu, nu = otu.tree_get(opt_state, "mu"), otu.tree_get(opt_state, "nu")
    step = int(otu.tree_get(opt_state, "count"))
    entries = {}
    for name in params:
        entry = {"exp_avg": to_torch(mu[name]), "exp_avg_sq": to_torch(nu[name])}
        if has_masters:
            entry["master"] = to_torch(params[name])
        entries[name] = entry
    return {"step": step, "params": entries}


def load_state_dict(opt_state, params: dict, state: dict, has_masters: bool):
    """(optimizer state, params) from a torch-layout state dict; masters replace ``params`` where both sides keep
    them. Raises ValueError naming what does not match."""
    saved = state["params"]
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved))[:5], sorted(set(saved) - set(params))[:5]
        raise ValueError(f"optimizer state does not match the model: missing {missing}, unexpected {extra}")
    mu_old, nu_old = otu.tree_get(opt_state, "mu"), otu.tree_get(opt_state, "nu")
    mu = {k: from_torch(saved[k]["exp_avg"], mu_old[k].dtype) for k in params}
    nu = {k: from_torch(saved[k]["exp_avg_sq"], nu_old[k].dtype) for k in params}
    count = jnp.asarray(int(state["step"]), jnp.int32)
    opt_state = otu.tree_set(opt_state, mu=mu, nu=nu, count=count)
    if has_masters:
        params = {k: from_torch(saved[k]["master"], params[k].dtype) if "master" in saved[k] else params[k]
                  for k in params}
    return opt_state, params


def _map_moments(opt_state, fn, **more):
    """opt_state with ``fn`` applied to its Adam moments (flat name -> array dicts) and ``more`` set as given."""
    return otu.tree_set(opt_state, mu=fn(otu.tree_get(opt_state, "mu")), nu=fn(otu.tree_get(opt_state, "nu")),
                        **more)


def place_moments(opt_state, mesh):
    """The Adam moments on their parameters' shardings (moetrain.jax.mesh) and the step count replicated over the
    mesh: the shardings the jitted update gives them back on, so it compiles once."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moetrain.jax.mesh import place

    count = jax.device_put(otu.tree_get(opt_state, "count"), NamedSharding(mesh, P()))
    return _map_moments(opt_state, lambda tree: place(tree, mesh), count=count)


def constrain_moments(opt_state, mesh):
    """Inside jit: the Adam moments kept on their parameters' shardings (``mesh.constrain``)."""
    from moetrain.jax.mesh import constrain

    return _map_moments(opt_state, lambda tree: constrain(tree, mesh))


def to_torch(x: jax.Array):
    """A CPU torch tensor of x (bf16 kept as bf16)."""
    import torch

    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(x))


def from_torch(t, dtype) -> jax.Array:
    return jnp.asarray(to_numpy(t), dtype=dtype)
