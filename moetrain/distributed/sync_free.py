"""The sync-free expert-parallel dispatcher (moe.dispatcher = sync_free): nothing routing-dependent is read on the
host, forward or backward, so the layer can be captured in a CUDA graph.

Legend as in ``expert_parallel``; C rows per (source, destination) pair, the static capacity.

Every rank sends each peer a fixed buffer of C rows (``all_to_all_single`` with equal splits: no counts on the
host), its rows for that peer first, sorted by local expert, then padding. The per-(peer, local expert) counts
travel beside them as a device tensor. The receiver computes, on the device, where each of its ep x C slots goes
in the expert-major order of its grouped GEMMs (padding slots go to a trash row), runs the experts on the ep x C
buffer (rows past the last group end are never read back), and returns the results in the same slots.

The worst case: C = T x min(K, El) (every token's rows on one peer), so each rank receives ep x T x min(K, El)
rows of H values: ep x min(K, El) / K times what an even split (T x K / ep per peer) needs, in memory and on the
wire. ``moe.dispatcher_capacity`` = c bounds it to C = ceil(c x T x K / ep); a rank's rows past C for one peer
are then dropped (they contribute zero, and ``dropped_rows`` counts them on the device).
"""

from __future__ import annotations

import torch

from moetrain.distributed.capacity import capacity

from moetrain.models.moe.dispatch import Dispatched, Dispatcher, permute_local
from moetrain.ops.dispatch import combine_rows


def _all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single with equal splits (dim 0 divided by the group size), with autograd."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


def slot_targets(recv_counts: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """recv_counts [ep, El] int64 (rows from source s for local expert e, packed first in s's C slots) ->
    (target [ep*C] int64: each slot's row in the expert-major order, ep*C (the trash row) for padding;
    offs [El] int32 group ends). Static shapes, no host read."""
    ep, El = recv_counts.shape
    ends = torch.cumsum(recv_counts, 1)  # [ep, El] segment ends within each source's slots
    j = torch.arange(C, device=recv_counts.device).expand(ep, C).contiguous()
    e = torch.searchsorted(ends, j, right=True)  # [ep, C] local expert of each slot; El = padding
    valid = e < El
    e_c = e.clamp(max=El - 1)
    totals = recv_counts.sum(0)
    expert_start = torch.cumsum(totals, 0) - totals  # [El]
    from_earlier_sources = torch.cumsum(recv_counts, 0) - recv_counts  # [ep, El]
    seg_start = ends - recv_counts
    pos = (expert_start[e_c] + from_earlier_sources.gather(1, e_c) + j - seg_start.gather(1, e_c))
    target = torch.where(valid, pos, torch.full_like(pos, ep * C)).reshape(-1)
    return target, torch.cumsum(totals, 0).to(torch.int32)


class _SFState:
    """The received rows the experts compute on (rows, offs, probs), and what ``combine`` needs."""

    def __init__(self, rows, offs, probs, local: Dispatched, send_index: torch.Tensor, target: torch.Tensor):
        self.rows, self.offs, self.probs = rows, offs, probs
        self.local, self.send_index, self.target = local, send_index, target


class SyncFreeDispatcher(Dispatcher):
    """Fixed-size all-to-all buffers; see the module doc."""

    def __init__(self, group, ep_size: int, num_experts: int, capacity_factor: float | None = None):
        self.group, self.ep, self.num_experts = group, ep_size, num_experts
        self.local_count = num_experts // ep_size
        self.capacity_factor = capacity_factor
        self.dropped_rows: torch.Tensor | None = None  # int64 [] device: rows dropped by the capacity so far

    def dispatch(self, x, topk_idx, topk_weight, experts):
        import torch.distributed as dist

        T, K = topk_idx.shape
        ep, El = self.ep, self.local_count
        C = capacity(T, K, ep, El, self.capacity_factor)
        local = permute_local(x, topk_idx, topk_weight, experts, self.num_experts)
        M, H = local.rows.shape
        offs = local.offs.long()
        counts = torch.diff(offs, prepend=offs.new_zeros(1)).reshape(ep, El)  # rows per (peer, local expert)
        peer_end = torch.cumsum(counts.sum(1), 0)  # [ep] end of each peer's rows in the sorted order
        peer_start = peer_end - counts.sum(1)
        row = torch.arange(M, device=x.device)
        peer = torch.searchsorted(peer_end, row, right=True).clamp(max=ep - 1)
        pos = row - peer_start[peer]
        kept = pos < C
        send_index = torch.where(kept, peer * C + pos, torch.full_like(pos, ep * C))  # trash slot ep*C
        drops = (~kept).sum()
        self.dropped_rows = drops if self.dropped_rows is None else self.dropped_rows + drops
        # counts as sent: the first C rows of each peer's, segment by segment
        ends = torch.cumsum(counts, 1)
        sent_counts = (ends.clamp(max=C) - (ends - counts).clamp(max=C)).contiguous()
        recv_counts = torch.empty_like(sent_counts)
        dist.all_to_all_single(recv_counts.view(-1), sent_counts.view(-1), group=self.group)
        buf = local.rows.new_zeros(ep * C + 1, H).index_copy(0, send_index, local.rows)[:ep * C]
        received = _all_to_all_equal(buf, self.group)
        target, offs_local = slot_targets(recv_counts, C)
        rows = received.new_zeros(ep * C + 1, H).index_copy(0, target, received)[:ep * C]
        probs = None
        if local.probs is not None:
            pbuf = local.probs.new_zeros(ep * C + 1).index_copy(0, send_index, local.probs)[:ep * C]
            probs = local.probs.new_zeros(ep * C + 1).index_copy(0, target, _all_to_all_equal(pbuf, self.group))
            probs = probs[:ep * C]
        return _SFState(rows, offs_local, probs, local, send_index, target)

    def combine(self, y_rows: torch.Tensor, state: _SFState) -> torch.Tensor:
        H = y_rows.shape[1]
        pad = y_rows.new_zeros(1, H)
        slots = torch.cat([y_rows, pad]).index_select(0, state.target)  # padding slots read the zero row
        back = _all_to_all_equal(slots, self.group)
        y_local = torch.cat([back, pad]).index_select(0, state.send_index)  # dropped rows read the zero row
        d = state.local
        return combine_rows(y_local, d.inverse, d.topk, d.topk_weight, d.impl)

    def __repr__(self) -> str:
        return f"SyncFreeDispatcher(ep={self.ep}, experts={self.num_experts}, capacity={self.capacity_factor})"
