"""Data and expert parallelism for the JAX trainer on the devices of one process, through jax.sharding.

The mesh has two axes, ("data", "ep"), of sizes (parallel.dp / parallel.ep, parallel.ep): every device is one
data-parallel rank (expert parallelism folds over the data ranks, as on the torch side). Then:

* each micro-batch [dp x micro_batch_size, S] is split over both axes (``batch_sharding``);
* the parameters are sharded FSDP-style (``param_shardings``): dim 0 over every device where it divides, else
  replicated; the routed experts' w1/w2/b1/b2 over "ep" on their expert dim (``expert_parallel``), and XLA
  gathers what each computation needs;
* the MoE layers exchange tokens by all-to-all over "ep" (``expert_parallel.apply_expert_parallel``).

The model code stays single-device: GSPMD partitions the jitted step from these input shardings, and the
gradients of replicated or sharded parameters are reduced over the data ranks by XLA.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moetrain.errors import UserError

AXES = ("data", "ep")
EXPERT_LEAVES = ("experts.w1", "experts.w2", "experts.b1", "experts.b2")


def build_mesh(parallel) -> Mesh:
    """A ("data", "ep") mesh over the first parallel.dp devices; a UserError where there are too few."""
    n, ep = parallel.dp, parallel.ep
    devices = jax.devices()
    if len(devices) < n:
        raise UserError(f"parallel.dp = {n}: train.backend=jax needs {n} devices in this process and finds "
                        f"{len(devices)} ({devices[0].platform}); lower parallel.dp")
    return Mesh(np.array(devices[:n]).reshape(n // ep, ep), AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a [B, S] batch over every device."""
    return NamedSharding(mesh, P(AXES))


def _over(mesh: Mesh, axes: tuple[str, ...]) -> P:
    """Dim 0 split over ``axes``, written without the mesh's size-1 axes: the form XLA gives a jitted step's
    outputs, so that the step's next inputs carry the shardings it was compiled for (P(("data", "ep")) and P("ep")
    place the same with one data rank, yet differ as inputs and make jit compile the step again)."""
    kept = tuple(a for a in axes if mesh.shape[a] > 1)
    return P(kept[0]) if len(kept) == 1 else P(kept) if kept else P()


def param_sharding(mesh: Mesh, name: str, shape: tuple) -> NamedSharding:
    """Experts over "ep" on dim 0; other parameters' dim 0 over every device where it divides; else replicated."""
    if name.endswith(EXPERT_LEAVES):
        return NamedSharding(mesh, _over(mesh, ("ep",)))
    if shape and shape[0] % mesh.size == 0:
        return NamedSharding(mesh, _over(mesh, AXES))
    return NamedSharding(mesh, P())


def place(tree: dict, mesh: Mesh) -> dict:
    """Each array of a flat name -> array dict on its ``param_sharding``."""
    return {k: jax.device_put(v, param_sharding(mesh, k, v.shape)) for k, v in tree.items()}


def constrain(tree: dict, mesh: Mesh) -> dict:
    """Inside jit: each array of a flat name -> array dict kept on its ``param_sharding``, so that a step's outputs
    come out as its inputs went in (GSPMD may otherwise pick another split, and the next call compiles again)."""
    return {k: jax.lax.with_sharding_constraint(v, param_sharding(mesh, k, v.shape)) for k, v in tree.items()}
