"""The rank order: which global rank holds which coordinate of every parallel dimension (pure Python).

One function, ``RankLayout.grid``, used by the device meshes (``distributed.mesh``) and the planner's
communication model (``plan.comm``/``plan.perf`` take their group strides from ``stride``).

Ranks are laid out outermost first as pp, dp_replicate, dp_shard, cp, tp (tp innermost: its ranks are neighbours
on one node). Expert parallelism folds over the dp_shard x cp x tp ranks of a replica, as Megatron's "EP folding":
the same consecutive ranks are read as efsdp, ep, etp (etp innermost), so an ep group is ep ranks spaced etp apart
and efsdp (the FSDP degree of the expert weights) is dp_shard x cp x tp / (ep x etp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "etp")


@dataclass(frozen=True)
class RankLayout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1

    @classmethod
    def from_config(cls, parallel) -> "RankLayout":
        p = parallel
        return cls(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp // p.dp_replicate, cp=p.cp, tp=p.tp,
                   ep=p.ep, etp=p.etp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    def sizes(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in dims)

    def grid(self, expert: bool = False) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(dim names, sizes), outermost first: the dense reading or the expert (folded) one of the same ranks."""
        dims = EXPERT_DIMS if expert else DENSE_DIMS
        return dims, self.sizes(dims)

    def stride(self, dim: str) -> int:
        """Rank distance between neighbours of ``dim`` (1 for tp and etp)."""
        dims = EXPERT_DIMS if dim in ("efsdp", "ep", "etp") else DENSE_DIMS
        return math.prod(self.sizes(dims[dims.index(dim) + 1:]))

    def coords(self, rank: int, expert: bool = False) -> dict[str, int]:
        """{dim: index} of global rank ``rank`` in the grid."""
        dims, sizes = self.grid(expert)
        out = {}
        for d, n in zip(reversed(dims), reversed(sizes)):
            out[d] = rank % n
            rank //= n
        return {d: out[d] for d in dims}


def check_world(layout: RankLayout, world_size: int) -> None:
    """ValueError unless the degrees multiply to the launched world size (named, with what would be valid)."""
    if layout.world_size != world_size:
        l = layout
        raise ValueError(
            f"the job has {world_size} process(es) but parallel.pp ({l.pp}) x parallel.dp ({l.dp}) x parallel.cp "
            f"({l.cp}) x parallel.tp ({l.tp}) = {l.world_size}; set the degrees so that they multiply to "
            f"{world_size} (e.g. parallel.dp={world_size // (l.pp * l.cp * l.tp) or 1}) or launch "
            f"{l.world_size} process(es)")
