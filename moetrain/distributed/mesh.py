"""Device meshes from the rank order (``distributed.layout``).

One root mesh is built over the expert reading of the ranks, (dp_replicate, efsdp, ep); the dense data-parallel
dims are flattened from it (dp_shard = efsdp x ep), so every mesh shares that root, as FSDP2 needs for expert
weights that are DTensors on the ep mesh and sharded again over efsdp. Meshes:

- ``dense_fsdp``: what FSDP2 shards the dense parameters over: (dp_replicate, dp_shard) for HSDP, else (dp_shard,).
- ``expert_fsdp``: the same for expert weights under expert parallelism: (dp_replicate, efsdp) or (efsdp,).
- ``ep``: the expert-parallel group (None at ep = 1).
- ``dp``: every data-parallel rank (the loss, metrics and expert counts are reduced over it).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.distributed.layout import RankLayout


@dataclass
class Meshes:
    layout: RankLayout
    root: object  # DeviceMesh (dp_replicate, efsdp, ep)
    dense_fsdp: object
    expert_fsdp: object
    ep: object | None
    dp: object


def build_meshes(layout: RankLayout, device_type: str) -> Meshes:
    """The meshes of ``layout`` (pp, cp, tp and etp must be 1: the trainer checks that first)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert layout.pp == layout.cp == layout.tp == layout.etp == 1, layout
    root = init_device_mesh(device_type, (layout.dp_replicate, layout.efsdp, layout.ep),
                            mesh_dim_names=("dp_replicate", "efsdp", "ep"))
    root["efsdp", "ep"]._flatten("dp_shard")
    dp = root["dp_replicate", "efsdp", "ep"]._flatten("dp")
    hsdp = layout.dp_replicate > 1
    dense = root["dp_replicate", "dp_shard"] if hsdp else root["dp_shard"]
    expert = root["dp_replicate", "efsdp"] if hsdp else root["efsdp"]
    return Meshes(layout, root, dense, expert, root["ep"] if layout.ep > 1 else None, dp)
