"""Device meshes from the rank order (``distributed.layout``).

Dense reading of a pipeline stage's ranks (pp outermost): (dp_replicate, dp_shard, tp); expert reading of the same
ranks: (dp_replicate, efsdp, ep), ep folding over dp_shard x tp (``RankLayout``; cp = etp = 1 here). FSDP2 needs the
meshes of a DTensor's placements and of its sharding to share one root, so one root mesh is built over a common
refinement of both readings and every mesh is a dim of it or a flattening of adjacent dims:

- tp divides ep (tp = 1 included): root (pp, dp_replicate, efsdp, ep_outer, tp) with ep_outer = ep / tp:
  dp_shard = (efsdp, ep_outer), ep = (ep_outer, tp);
- ep divides tp: root (pp, dp_replicate, dp_shard, tp_outer, ep) with tp_outer = tp / ep:
  tp = (tp_outer, ep), efsdp = (dp_shard, tp_outer).
Neither dividing the other is refused by ``Config.check``.

Meshes (None where the degree is 1, except the data meshes):
- ``dense_fsdp``: what FSDP2 shards the dense parameters over: (dp_replicate, dp_shard) for HSDP, else (dp_shard,).
- ``expert_fsdp``: the same for expert weights when they form their own FSDP unit (ep > 1 or tp > 1):
  (dp_replicate, efsdp) or (efsdp,).
- ``ep``, ``tp``, ``pp``: the expert-, tensor- and pipeline-parallel groups.
- ``dp``: every data-parallel rank of this rank's (pp, tp) coordinate (the loss, metrics and expert counts are
  reduced over it; each reads its own share of the data).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.distributed.layout import RankLayout


@dataclass
class Meshes:
    layout: RankLayout
    root: object  # DeviceMesh over the refinement above
    dense_fsdp: object
    expert_fsdp: object
    ep: object | None
    dp: object
    tp: object | None = None
    pp: object | None = None


def refinement(layout: RankLayout) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(root dim names, sizes) of the common refinement (see the module doc); ValueError where neither of tp and ep
    divides the other."""
    l = layout
    if l.ep % l.tp == 0:
        return (("pp", "dp_replicate", "efsdp", "ep_outer", "tp"),
                (l.pp, l.dp_replicate, l.efsdp, l.ep // l.tp, l.tp))
    if l.tp % l.ep == 0:
        return (("pp", "dp_replicate", "dp_shard", "tp_outer", "ep"),
                (l.pp, l.dp_replicate, l.dp_shard, l.tp // l.ep, l.ep))
    raise ValueError(f"parallel.tp = {l.tp} and parallel.ep = {l.ep}: one must divide the other")


def build_meshes(layout: RankLayout, device_type: str) -> Meshes:
    """The meshes of ``layout`` (cp and etp must be 1: the trainer checks that first)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert layout.cp == layout.etp == 1, layout
    names, sizes = refinement(layout)
    root = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    # flattened meshes are kept as _flatten returns them (slicing one back out of the root is deprecated)
    if names[-1] == "tp":  # tp divides ep
        flat = {"dp_shard": root["efsdp", "ep_outer"]._flatten("dp_shard"), "efsdp": root["efsdp"],
                "ep": root["ep_outer", "tp"]._flatten("ep"), "tp": root["tp"]}
        data = ("dp_replicate", "efsdp", "ep_outer")
    else:
        flat = {"tp": root["tp_outer", "ep"]._flatten("tp"), "efsdp": root["dp_shard", "tp_outer"]._flatten("efsdp"),
                "dp_shard": root["dp_shard"], "ep": root["ep"]}
        data = ("dp_replicate", "dp_shard")
    dp = root[data]._flatten("dp")
    if layout.dp_replicate > 1:  # HSDP: 2-D meshes (replicate, shard)
        dense, expert = root["dp_replicate", "dp_shard"], root["dp_replicate", "efsdp"]
    else:
        dense, expert = flat["dp_shard"], flat["efsdp"]
    return Meshes(layout, root, dense, expert, flat["ep"] if layout.ep > 1 else None, dp,
                  tp=flat["tp"] if layout.tp > 1 else None, pp=root["pp"] if layout.pp > 1 else None)
