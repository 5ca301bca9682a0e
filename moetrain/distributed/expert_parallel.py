"""Expert parallelism: each rank of an ep group holds E / ep experts, and a dispatcher moves routed rows to them.

Legend: T tokens, H hidden, E experts (global), El = E / ep local experts, K top-k, M = T*K rows sent by this rank,
R rows received by it, ep ranks in the group. Expert e lives on ep rank e // El as its local expert e % El.

``shard_experts`` replaces each MoE layer's expert weights by DTensors sharded on dim 0 over the ep mesh (global
shape [E, ...], so checkpoints and initialisation see the whole tensor) and installs the configured dispatcher.

``AllToAllDispatcher`` (moe.dispatcher = alltoall):
  1. rows sorted by global expert on this rank (``ops.dispatch.permute_tokens``; routing weights travel as probs);
  2. per-(rank, local expert) counts exchanged with one all-to-all of ep x El integers;
  3. one host read of the send and receive splits (the layer's only synchronisation);
  4. rows and probs sent with ``all_to_all_single`` (autograd: the backward sends the gradients back the same way);
  5. received rows, ordered (source rank, local expert), regrouped to (local expert, source rank) for the grouped
     GEMMs; the results go back the reverse way and the top-k sum happens on the token's own rank.
"""

from __future__ import annotations

import torch

from moetrain.models.moe.dispatch import Dispatched, Dispatcher, permute_local
from moetrain.ops.dispatch import combine_rows


def local_experts(param: torch.Tensor) -> torch.Tensor:
    """This rank's slice of an expert weight (the DTensor's local tensor), or the tensor itself."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def regroup_index(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """recv_counts [ep, El] int64 (rows from source s for local expert e, in the received order s-major) -> index
    [total] int64 with regrouped = received[index] in (local expert, source) order. No host read."""
    ep, El = recv_counts.shape
    flat = recv_counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(ep, El).t().reshape(-1)  # segment starts, expert-major
    sizes = recv_counts.t().reshape(-1)
    seg_start_out = torch.cumsum(sizes, 0) - sizes
    seg = torch.repeat_interleave(torch.arange(ep * El, device=flat.device), sizes, output_size=total)
    return starts[seg] + torch.arange(total, device=flat.device) - seg_start_out[seg]


class _EPDispatched:
    """The received rows the experts compute on (rows, offs, probs), and what ``combine`` needs to bring y back:
    the local permutation, the two directions' splits, the regrouping index."""

    def __init__(self, rows, offs, probs, local: Dispatched, send_splits, recv_splits, index):
        self.rows, self.offs, self.probs = rows, offs, probs
        self.local, self.send_splits, self.recv_splits, self.index = local, send_splits, recv_splits, index


class AllToAllDispatcher(Dispatcher):
    """Sends each routed row to the ep rank owning its expert and back (see the module doc)."""

    def __init__(self, group, ep_size: int, num_experts: int):
        self.group, self.ep, self.num_experts = group, ep_size, num_experts
        self.local_count = num_experts // ep_size

    def dispatch(self, x, topk_idx, topk_weight, experts):
        import torch.distributed as dist

        local = permute_local(x, topk_idx, topk_weight, experts, self.num_experts)
        offs = local.offs.long()
        send_counts = torch.diff(offs, prepend=offs.new_zeros(1)).reshape(self.ep, self.local_count)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts.view(-1), send_counts.reshape(-1).contiguous(), group=self.group)
        splits = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the one host read
        send_splits, recv_splits = splits[:self.ep], splits[self.ep:]
        total = sum(recv_splits)
        received = _all_to_all(local.rows, recv_splits, send_splits, self.group)
        index = regroup_index(recv_counts, total)
        rows = received.index_select(0, index)
        offs_local = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)
        probs = None
        if local.probs is not None:
            probs = _all_to_all(local.probs, recv_splits, send_splits, self.group).index_select(0, index)
        return _EPDispatched(rows, offs_local, probs, local, send_splits, recv_splits, index)

    def combine(self, y_rows: torch.Tensor, state: _EPDispatched) -> torch.Tensor:
        back = torch.zeros_like(y_rows).index_copy(0, state.index, y_rows)  # (source, expert) order again
        y_local = _all_to_all(back, state.send_splits, state.recv_splits, self.group)
        d = state.local
        return combine_rows(y_local, d.inverse, d.topk, d.topk_weight, d.impl)

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep={self.ep}, experts={self.num_experts})"


def shard_experts(model, ep_mesh, moe, group=None) -> None:
    """Each MoE layer's expert weights -> DTensors Shard(0) over ``ep_mesh``, this rank keeping its experts; the
    layer's dispatcher -> moe.dispatcher's, sending over ``group`` (default: the ep mesh's; another group of the same
    ranks keeps its collectives apart from other layers'). Works on a meta model (nothing is copied)."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    group = ep_mesh.get_group() if group is None else group
    for layer in model.moe_layers():
        experts = layer.experts
        E = experts.w1.shape[0]
        for name in ("w1", "w2", "b1", "b2"):
            p = getattr(experts, name)
            if p is None:
                continue
            local = p.detach().chunk(ep, dim=0)[rank].clone() if not p.is_meta else p.detach().chunk(ep)[rank]
            setattr(experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                                                   shape=p.shape, stride=p.stride())))
        if moe.dispatcher == "alltoall":
            layer.dispatcher = AllToAllDispatcher(group, ep, E)
        else:
            from moetrain.distributed.sync_free import SyncFreeDispatcher

            layer.dispatcher = SyncFreeDispatcher(group, ep, E, moe.dispatcher_capacity)
