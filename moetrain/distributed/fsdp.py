"""FSDP2 data parallelism: ``fully_shard`` per decoder block, per MTP depth, and the root.

The sharded parameters are the optimizer's: fp32 master weights (precision.master_weights) or the bf16 state;
forward and backward run in the compute dtype (``MixedPrecisionPolicy.param_dtype``) and gradients are reduced in
optim.main_grads_dtype (``reduce_dtype``). Under expert or tensor parallelism the expert weights (DTensors on the
ep mesh, or plain tensors) form a unit of their own on the expert FSDP mesh (dp x tp / ep ranks). FSDP averages
their gradients over that mesh, but each rank's gradient holds its tokens' part (tensor parallelism splits the
tokens over the tp ranks) summed over its ep group (the all-to-all's backward brought them), while the step's
gradient is the sum over all dp x tp ranks' parts divided by dp: the trainer multiplies them by tp / ep once per
step (``expert_grad_factor``, ``expert_grad_scale``; gloo has no pre-multiplied reduce for FSDP's own divide
factor). Parameters replicated over tp with per-rank partial gradients are Replicate DTensors on the tp mesh:
FSDP2 sums them over tp before its reduce (``distributed.tensor_parallel``).

Blocks reshard after forward (all-gathered again for backward), FSDP's own prefetch overlapping the next block's
all-gather with this one's compute; the root (embedding, final norm, head) stays unsharded between forward and
backward, being the last to run forward and the first backward.
"""

from __future__ import annotations

import torch


def apply_fsdp(model, meshes, param_dtype: torch.dtype, reduce_dtype: torch.dtype, root=None,
               reshard_blocks: bool = True) -> None:
    """FSDP2 units: each block (its experts a unit of their own under expert parallelism), each MTP depth, and the
    root: ``model``, or ``root`` (a module holding ``model``: a pipeline stage's wrapper, which torch's pipeline
    schedule must see as the FSDP module to control the gradient reduce). ``reshard_blocks=False`` keeps the blocks'
    parameters gathered from their first forward to the step's end: a pipeline runs many micro-batches' forwards
    before their backwards, and would all-gather again for each."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    unit = {"mp_policy": mp, "reshard_after_forward": reshard_blocks}
    own_unit = meshes.ep is not None or meshes.tp is not None  # the experts' own unit over expert_fsdp
    for _, block in model.blocks():
        if own_unit and block.is_moe:
            fully_shard(block.mlp.experts, mesh=meshes.expert_fsdp, **unit)
            # the dispatcher calls compute_rows, not forward: gather the experts around that call
            register_fsdp_forward_method(block.mlp.experts, "compute_rows")
        fully_shard(block, mesh=meshes.dense_fsdp, **unit)
    for depth in model.mtp.values():
        fully_shard(depth, mesh=meshes.dense_fsdp, **unit)
    fully_shard(model if root is None else root, mesh=meshes.dense_fsdp, mp_policy=mp, reshard_after_forward=False)


def expert_params(model) -> list:
    """The expert weights of every MoE layer held (DTensors under expert parallelism)."""
    return [p for layer in model.moe_layers() for p in layer.experts.parameters()]


def expert_grad_factor(tp: int, ep: int) -> float:
    """What the expert weights' gradients are multiplied by after FSDP's average over the expert FSDP mesh: tp / ep
    (see the module doc)."""
    return tp / ep


def expert_grad_scale(params: list, factor: float) -> None:
    """Multiply the expert weights' reduced gradients by ``factor`` (``expert_grad_factor``)."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
