"""Recompute layer ids chosen per pipeline rank from each rank's own memory headroom.

The loop the reference engineers ran by hand (dump per-rank memory, find the ranks with headroom, drop their layers
from the recompute list, repeat until the peak rank approaches the ceiling), on the projection: start with every
block recomputed in full (train.recompute_layer_ids = all blocks; the others follow train.recompute, ``base``), and
give each rank back as many of its blocks as still fit. A rank's projected memory depends only on its own blocks'
recompute modes (its stages' activations through its own schedule order), so all ranks are searched at once: per
rank a binary search on how many of its blocks leave the list, one memory projection per round for all ranks.
A rank gives back the blocks of its later stages first (fewer micro-batches of them are in flight, so each costs
less memory), within a stage the last layer first.

"Fits" is the planner's verdict: the rank's first-step peak with fragmentation within ``memory.AT_RISK`` of the
usable memory. Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moetrain.config.schema import Config
from moetrain.plan.layout import parse_layout
from moetrain.plan.memory import AT_RISK, GiB, MemoryReport, project_memory


@dataclass
class RecomputeChoice:
    base: str  # train.recompute for the blocks not listed ("full" when every block is recomputed)
    ids: list[int] | None  # train.recompute_layer_ids
    per_rank: list[int]  # blocks recomputed in full on each pipeline rank
    memory: MemoryReport
    projections: int  # memory projections the search ran

    def overrides(self) -> dict:
        return {"train.recompute": self.base, "train.recompute_layer_ids": self.ids}

    def mode_of(self, gid: int) -> str:
        return "full" if (self.base == "full" or (self.ids and gid in self.ids)) else self.base


def _with(cfg: Config, base: str, ids: list[int] | None) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute=base, recompute_layer_ids=ids))


def _rank_fits(rep: MemoryReport) -> list[bool]:
    limit = AT_RISK * rep.usable_gib * GiB
    return [r.first_step + r.fragmentation <= limit for r in rep.ranks]


def drop_order(cfg: Config) -> list[list[int]]:
    """Per pipeline rank, its block ids in the order they leave the recompute list."""
    layout, L = parse_layout(cfg), cfg.model.num_layers
    out = []
    for r in range(layout.pp):
        stages = sorted(layout.stages_of_rank(r), key=lambda s: -s.index)
        out.append([gid for st in stages for gid in reversed(st.block_ids(L))])
    return out


def choose(cfg: Config, hw, base: str, attention: str = "auto", moe_imbalance: float = 1.0
           ) -> RecomputeChoice | None:
    """The recompute ids for ``cfg`` (its layout and schedule) with train.recompute = ``base`` elsewhere; None when
    even recomputing every block does not fit."""
    project = lambda c: project_memory(c, hw, attention=attention, moe_imbalance=moe_imbalance)  # noqa: E731
    blocks = cfg.model.num_layers + cfg.model.mtp_num_layers
    order = drop_order(cfg)
    every = project(_with(cfg, base, list(range(blocks))))
    if every.verdict != "fits":
        return None
    plain = project(_with(cfg, base, None))
    runs = 2
    if plain.verdict == "fits":
        return RecomputeChoice(base, None, [0] * len(order), plain, runs)
    lo = [len(o) if ok else 0 for o, ok in zip(order, _rank_fits(plain))]  # blocks given back, known to fit
    hi = [len(o) if ok else len(o) - 1 for o, ok in zip(order, _rank_fits(plain))]
    while any(a < b for a, b in zip(lo, hi)):
        mid = [(a + b + 1) // 2 for a, b in zip(lo, hi)]
        rep = project(_with(cfg, base, _ids(order, mid)))
        runs += 1
        for r, ok in enumerate(_rank_fits(rep)):
            if lo[r] < hi[r]:
                lo[r], hi[r] = (mid[r], hi[r]) if ok else (lo[r], mid[r] - 1)
    ids = _ids(order, lo)
    final = project(_with(cfg, base, ids or None))
    runs += 1
    per_rank = [len(o) - k for o, k in zip(order, lo)]
    if len(ids) == blocks:
        return RecomputeChoice("full", None, per_rank, final, runs)
    return RecomputeChoice(base, ids or None, per_rank, final, runs)


def _ids(order: list[list[int]], given_back: list[int]) -> list[int]:
    """The recompute list: every rank's blocks but the first ``given_back[r]`` of its drop order."""
    return sorted(gid for o, k in zip(order, given_back) for gid in o[k:])
