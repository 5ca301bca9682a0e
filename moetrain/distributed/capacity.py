"""The sync-free dispatcher's static receive capacity (``sync_free``'s module doc says why); pure Python, shared
with the planner."""

from __future__ import annotations

import math


def capacity(tokens: int, topk: int, ep: int, local_count: int, factor: float | None) -> int:
    """C: rows one rank may send one peer: the worst case tokens x min(topk, local experts), or with
    moe.dispatcher_capacity = factor, ceil(factor x tokens x topk / ep)."""
    if factor is None:
        return tokens * min(topk, local_count)
    return max(1, math.ceil(factor * tokens * topk / ep))
