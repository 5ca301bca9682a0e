"""FSDP2's memory and communication terms, as the distributed trainer runs it (``moetrain.distributed.fsdp``).

Whenever a job has more than one rank, parameters, gradients and optimizer state are sharded: dense parameters
over dp_shard x cp ranks, routed experts (already split over ep x etp) over the expert FSDP ranks
(``RankLayout.efsdp``); HSDP replicates the shards over dp_replicate. Per rank:

* params: the sharded storage (fp32 where precision.master_weights or precision.dtype = fp32: it is the master
  copy, no separate one), params x storage bytes / shard degree;
* grads: the sharded gradients FSDP's reduce-scatter leaves, in the storage dtype; with gradient accumulation
  (m > 1 micro-batches, reduced on the last only) the unsharded gradients of every parameter are kept between
  micro-batches, in optim.main_grads_dtype (FSDP's reduce dtype);
* optimizer: the Adam moments of the shard;
* gathered: the unsharded parameters (compute dtype) alive while a block runs: the root (embedding, head, final
  norm: kept between forward and backward) plus the current and the prefetched block; in backward one block's
  unsharded gradient and its reduce-dtype copy for the reduce-scatter. A pipeline rank (pp > 1) keeps every block
  of its stages gathered from its first forward to the step's end (``apply_fsdp(reshard_blocks=False)``: torch's
  schedule runs many forwards before their backwards), so all its local parameters are gathered.

Communication per step: without a pipeline each block's parameters are all-gathered in forward and again in
backward on every micro-batch (blocks reshard after forward); a pipeline rank gathers them once, in its first
forward. The gradients are reduce-scattered once (and all-reduced over dp_replicate under HSDP). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.schema import Config
from moetrain.distributed.layout import RankLayout

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def applies(cfg: Config) -> bool:
    """Whether the trainer shards with FSDP2: any job of more than one rank."""
    return cfg.parallel.world_size > 1


def pipelined(cfg: Config) -> bool:
    """Whether the blocks stay gathered for the whole step (a pipeline rank: ``reshard_blocks=False``)."""
    return cfg.parallel.pp > 1


def shard_degrees(cfg: Config) -> tuple[int, int]:
    """(dense shard degree dp_shard x cp, expert shard degree efsdp)."""
    r = RankLayout.from_config(cfg.parallel)
    return r.dp_shard * r.cp, max(r.efsdp, 1)


def storage_bytes(cfg: Config) -> int:
    """Bytes per element of the sharded parameters (and their gradients): fp32 masters or the compute dtype."""
    fp32 = cfg.precision.master_weights or cfg.precision.dtype == "fp32"
    return 4 if fp32 else DTYPE_BYTES[cfg.precision.dtype]


@dataclass
class FsdpMemory:
    params: float  # sharded parameter storage
    grads: float  # sharded gradients after the step's reduce-scatter
    accumulated: float  # unsharded gradients kept between micro-batches (m > 1), reduce dtype
    optimizer: float  # the shard's Adam moments
    gathered_forward: float  # unsharded parameters alive in forward: root + current + prefetched block
    gathered_backward: float  # the same in backward, plus one block's unsharded gradient and its reduce copy


def memory(cfg: Config, dense: float, expert: float, root: float, largest_block: float, m: int) -> FsdpMemory:
    """Bytes for a rank holding ``dense`` and ``expert`` local parameters (before FSDP), ``root`` of them in the
    root unit (embedding, head), ``largest_block`` in its largest block; ``m`` micro-batches per step."""
    o = cfg.optim
    sd, se = shard_degrees(cfg)
    shard = dense / sd + expert / se
    b_s, b_p, b_g = storage_bytes(cfg), DTYPE_BYTES[cfg.precision.dtype], DTYPE_BYTES[o.main_grads_dtype]
    gathered = b_p * ((dense + expert) if pipelined(cfg) else (root + 2 * largest_block))
    return FsdpMemory(
        params=b_s * shard, grads=b_s * shard, accumulated=b_g * (dense + expert) if m > 1 else 0.0,
        optimizer=(DTYPE_BYTES[o.exp_avg_dtype] + DTYPE_BYTES[o.exp_avg_sq_dtype]) * shard,
        gathered_forward=gathered, gathered_backward=gathered + (b_p + b_g) * largest_block)


def comm_seconds(cfg: Config, comm, hw, dense: float, expert: float, m: int, links: tuple) -> float:
    """Seconds of FSDP communication per step for a rank holding ``dense`` and ``expert`` local parameters;
    ``links`` = (dense link, expert link, replicate link) from ``comm.group_link``."""
    sd, se = shard_degrees(cfg)
    b_p, b_g = DTYPE_BYTES[cfg.precision.dtype], DTYPE_BYTES[cfg.optim.main_grads_dtype]
    dense_link, expert_link, replicate_link = links
    rounds = 1 if pipelined(cfg) else 2 * m  # gathered once per step, or in forward and backward per micro-batch
    gathers = rounds * (comm.all_gather(b_p * dense, sd, dense_link) + comm.all_gather(b_p * expert, se, expert_link))
    reduce = comm.reduce_scatter(b_g * dense, sd, dense_link) + comm.reduce_scatter(b_g * expert, se, expert_link)
    replicas = cfg.parallel.dp_replicate
    if replicas > 1:
        reduce += comm.all_reduce(b_g * (dense / sd + expert / se), replicas, replicate_link)
    return gathers + reduce
