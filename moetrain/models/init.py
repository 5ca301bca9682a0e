"""Weight initialisation that gives every parameter the same values however it is sharded.

A parameter's values are a function of (base seed, parameter name, global shape) only: its rows (dim 0) are cut
into blocks of ``rows_per_block(shape)`` rows, and block b is drawn from a generator seeded with a hash of
(base seed, name, b). A rank holding rows [a, a + n) of dim 0 (an FSDP shard, an expert-parallel rank's experts,
a pipeline stage's layers under their global names) draws only the blocks that cover them and keeps its slice,
so a sharded model and a single-device one built from the same base seed hold the same weights on the same device
type (CPU and CUDA generators draw different numbers). Shards of a further dim (a DTensor's _StridedShard or
Shard(1)) are cut from the drawn rows.

The base seed comes from torch's global RNG (one draw per model), so ``torch.manual_seed(s)`` before the build
decides the weights, as it did when init drew from the global RNG directly.
"""

from __future__ import annotations

import hashlib
import math

import torch

BLOCK_ELEMENTS = 1 << 20  # elements per drawn block, about: few generators for small tensors, little waste per shard


def base_seed() -> int:
    """One draw from torch's global RNG: the seed every parameter's values derive from."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu").item())


def rows_per_block(shape: torch.Size | tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def local_view(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the tensor this rank holds, the global shape, the global offset of its first element per dim)."""
    from_dtensor = _dtensor_layout(param)
    if from_dtensor is not None:
        return from_dtensor
    return param, tuple(param.shape), (0,) * param.dim()


def _dtensor_layout(param):
    import sys

    if "torch.distributed.tensor" not in sys.modules:  # no DTensor exists unless that module was imported
        return None
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(param.shape), tuple(offset)


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill ``param`` (a tensor or a DTensor) with normal(0, std) values that depend on (seed, name, global shape)
    alone. Local shards must be contiguous ranges in every dim (FSDP2's and expert parallelism's are)."""
    local, shape, offset = local_view(param)
    if local.numel() == 0 or local.is_meta:  # a meta build allocates nothing: init_weights runs after to_empty
        return
    if local.dim() == 0:
        g = torch.Generator(device=local.device).manual_seed(_block_seed(seed, name, 0))
        local.copy_(torch.randn((), generator=g, device=local.device, dtype=torch.float32) * std)
        return
    block = rows_per_block(shape)
    first, count = offset[0], local.shape[0]
    b0, b1 = first // block, (first + count - 1) // block
    pieces = []
    for b in range(b0, b1 + 1):
        rows = min(block, shape[0] - b * block)
        g = torch.Generator(device=local.device).manual_seed(_block_seed(seed, name, b))
        pieces.append(torch.randn((rows, *shape[1:]), generator=g, device=local.device, dtype=torch.float32))
    drawn = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    start = first - b0 * block
    values = drawn[start:start + count]
    for dim in range(1, local.dim()):
        values = values.narrow(dim, offset[dim], local.shape[dim])
    local.copy_(values.mul_(std) if values.is_contiguous() else values * std)
