"""Communication model: ring collectives, all-to-all and point-to-point over a two-level network.

Ranks are ordered as Megatron lays them out: tensor parallel innermost, then context, then
data parallel, pipeline outermost; expert parallel groups are formed inside dp x cp x tp with
the expert-tensor-parallel ranks innermost. A group of n ranks with stride s spans n * s
consecutive ranks: it stays inside a node (hardware.intra_node_gbps, NVLink / Infinity Fabric)
when that fits in gpus_per_node, else it crosses the network (inter_node_gbps per GPU, the NIC
being each rank's bottleneck in a ring).

* all-reduce (ring): 2 (n-1)/n x bytes / bw + 2 (n-1) x latency
* all-gather / reduce-scatter (ring): (n-1)/n x bytes / bw + (n-1) x latency
* all-to-all: each rank sends (n-1)/n of its bytes; the part to peers in its node goes over the
  node link, the rest over the NIC, in parallel: max(intra / intra_bw, inter / inter_bw) +
  latency; ``imbalance`` scales the bytes (the slowest rank sets the pace).
* point-to-point: latency + bytes / bw.
Bandwidths in bytes/s, sizes in bytes, times in seconds. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    bw: float  # bytes/s per GPU per direction
    latency: float  # seconds per step


def group_link(hw, n: int, stride: int, gpus_per_node: int | None = None) -> Link:
    """The bottleneck link of a group of n ranks spaced ``stride`` apart."""
    gpn = gpus_per_node or hw.gpus_per_node
    if n <= 1:
        return Link(float("inf"), 0.0)
    if n * stride <= gpn:
        return Link(hw.intra_node_gbps * 1e9, hw.intra_node_latency_us * 1e-6)
    return Link(hw.inter_node_gbps * 1e9, hw.inter_node_latency_us * 1e-6)


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bw + 2 * (n - 1) * link.latency


def all_gather(nbytes: float, n: int, link: Link) -> float:
    """Also reduce-scatter: ``nbytes`` is the full (unsharded) size."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bw + (n - 1) * link.latency


reduce_scatter = all_gather


def all_to_all(nbytes: float, n: int, stride: int, hw, imbalance: float = 1.0, gpus_per_node: int | None = None) -> float:
    """Time for every rank of an n-rank group (spaced ``stride``) to exchange ``nbytes`` of
    its data evenly with the others."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    gpn = gpus_per_node or hw.gpus_per_node
    in_node = max(min(n, gpn // max(stride, 1)), 1)  # group members sharing my node
    per_peer = nbytes * imbalance / n
    intra = per_peer * (in_node - 1)
    inter = per_peer * (n - in_node)
    t = max(intra / (hw.intra_node_gbps * 1e9), inter / (hw.inter_node_gbps * 1e9) if inter else 0.0)
    lat = hw.inter_node_latency_us if inter else hw.intra_node_latency_us
    return t + lat * 1e-6


def p2p(nbytes: float, link: Link) -> float:
    if nbytes <= 0 or link.bw == float("inf"):
        return 0.0
    return link.latency + nbytes / link.bw
