"""TMA descriptors of bf16 tensors for the Gluon kernels (wgrad_pingpong.py, rowgroup_pingpong.py), whose shared
layouts must be explicit: the default 128-byte-swizzled NVMMA layout of each block.

    shared_layout(block)         the NVMMA shared layout of a bf16 block
    descriptor(t, shape, strides, block)
    ragged_desc(t, block)        t [M, C] (row stride t.stride(0)) as grouped_gemm_kernels' "ragged" 4-D descriptor,
                                 block [1, 1, *block]: rows at or past a group's end read as zeros, stores dropped
    aot_type(block)              the descriptor's type in a kernel signature, for ahead-of-time compiles
"""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl

from moetrain.kernels.grouped_gemm_kernels import ragged_geometry


def shared_layout(block: list):
    return _shared_layout(tuple(block))


# ~6 us of Python per descriptor otherwise, 14 descriptors per layer call (`moetrain bench host`;
# bench/archive/2026-11-30_0217-0349.md)
@functools.cache
def _shared_layout(block: tuple):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def descriptor(t: torch.Tensor, shape: list, strides: list, block: list):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, shape, strides, block, shared_layout(block))


def ragged_desc(t: torch.Tensor, block: list):
    return descriptor(t, *ragged_geometry(t.shape[1], t.stride(0)), [1, 1, *block])


def aot_type(block: list) -> str:
    return f"tensordesc<bf16[{', '.join(str(b) for b in block)}],{shared_layout(block)!r}>"
