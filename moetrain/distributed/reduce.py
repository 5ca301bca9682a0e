"""Reductions over ranks: the global gradient norm over parameters sharded on different meshes, and the step's
loss terms and expert counts over the data-parallel ranks.

A parameter's share of the squared norm is its local shard's; summing those over the mesh dims it is sharded on
(not the ones it is replicated on) gives its whole squared norm. Parameters are grouped by those dims, so one
all-reduce per group (dense: dp_shard; experts: efsdp then ep) serves them all.
"""

from __future__ import annotations

import torch


def shard_groups(param) -> tuple:
    """The process groups ``param``'s shards are spread over (empty for a plain tensor or a replica)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return ()
    mesh = param.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(param.placements) if pl.is_shard()
                 or type(pl).__name__ == "_StridedShard")


def global_sq_norm(local_sq: list[torch.Tensor], groups: list[tuple]) -> torch.Tensor:
    """sum over parameters of their whole squared norms, from each one's local squared norm [] fp32 and its
    ``shard_groups``; the same value on every rank."""
    import torch.distributed as dist

    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for sq, g in zip(local_sq, groups):
        by_groups.setdefault(g, []).append(sq)
    total = None
    for g, parts in sorted(by_groups.items(), key=lambda kv: len(kv[0])):
        s = torch.stack(parts).sum()
        for group in g:
            dist.all_reduce(s, group=group)
        total = s if total is None else total + s
    return total


def mean_over(t: torch.Tensor, group) -> torch.Tensor:
    """All-reduce average of ``t`` over ``group`` (in place; returns it)."""
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
    return t.div_(dist.get_world_size(group))


def sum_over(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
    return t
