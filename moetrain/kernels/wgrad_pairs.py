"""Weight gradient ping-pong over dw tile pairs that share their dy blocks (Gluon, Hopper).

Legend as in grouped_gemm.py: M grouped rows, G groups, dy [M, N], x [M, K], offs [G] int32 cumulative row ends.

    dw [G, N, K] = dy_g^T @ x_g per group (bf16 in, fp32 accumulation, bf16 out; empty groups: zeros)

The schedule is wgrad_pingpong.py's (a producer warp, two consumer warpgroups taking turns at the tensor cores, each
with whole 128x128 dw tiles), with one change: the program's tiles come in pairs, (n0, k0) and (n0, k0 + 128), the
first for consumer 0 and the second for consumer 1. Both tiles reduce over the same dy column block, so where a pair's
reduction fits the dy ring (steps <= DY_STAGES), consumer 1 reads the dy blocks consumer 0 read and releases them:
a pair loads 3 blocks per step instead of 4.

Why: at DeepSeek-V3 (4 reduction steps per tile on balanced routing) the plain ping-pong keeps the tensor pipe 72%
busy; its consumers wait for data at each tile's start while the producer waits for free stages, and 128x128 tiles
read 64 FLOP per byte from L2 (bench/NOTES.md, session 21). Sharing dy reads 85 FLOP per byte and halves what the
second tile of a pair must wait for at its start.

Two rings: dy (DY_STAGES blocks [BR, 128]) and x (X_STAGES blocks [BR, 128]). The producer loads in the order the
consumers read: for each pair, consumer 0's steps (a dy block and an x block each), then consumer 1's (its x block,
and its own dy block when the pair does not share). A shared pair needs steps <= DY_STAGES: consumer 1 releases the dy
blocks, after consumer 0 has run every step, so a longer reduction would wait on itself. Longer reductions load dy per
tile, as the plain kernel does. Dropped rows and partial tiles as in wgrad_pingpong.py (ragged descriptors; loads past
a group's end read zeros, stores past N or K are clipped).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from moetrain.kernels import cuda_device
from moetrain.kernels.gluon_descs import aot_type, descriptor, ragged_desc
from moetrain.kernels.grouped_gemm_kernels import RAGGED_ROWS
from moetrain.kernels.host import cdiv
from moetrain.kernels.schedule import skew_schedule
from moetrain.kernels.wgrad_pingpong import BLOCK_R, CONSUMER_REGS, PRODUCER_REGS, _tile

TILE = 128  # each consumer's dw tile is TILE x TILE (a 128x128 fp32 accumulator: 128 registers per thread)
DY_STAGE_CHOICES = (4, 5, 6)  # 6 dy + 4 x stages + two 32 KB store buffers: 224 KB of the H200's 227


@gluon.jit
def _pair(pair, offs_ptr, sched_ptr, M, tiles_n, pairs_k, total, NUM_PROGS, TN: gl.constexpr, TK: gl.constexpr,
          BR: gl.constexpr, GROUP_N: gl.constexpr, SORTED: gl.constexpr):
    """_tile over pairs: a pair is a TN x 2TK tile, its first TK columns consumer 0's, the next TK consumer 1's."""
    PAIR_K: gl.constexpr = 2 * TK
    return _tile(pair, offs_ptr, sched_ptr, M, tiles_n, pairs_k, total, NUM_PROGS, TN, PAIR_K, BR, GROUP_N, 1, False,
                 SORTED)


@gluon.jit
def _producer(dy_desc, x_desc, dy_bufs, x_bufs, dy_ready, dy_empty, x_ready, x_empty, offs_ptr, sched_ptr, M,
              tiles_n, pairs_k, total, NUM_PROGS, TN: gl.constexpr, TK: gl.constexpr, BR: gl.constexpr,
              GROUP_N: gl.constexpr, SORTED: gl.constexpr, RAGGED: gl.constexpr):
    DY_STAGES: gl.constexpr = dy_bufs.type.shape[0]
    dy_it = 0
    x_it = 0
    for pair in range(gl.program_id(0), total, NUM_PROGS):
        g, n0, k0, row0, row_end, steps = _pair(pair, offs_ptr, sched_ptr, M, tiles_n, pairs_k, total, NUM_PROGS,
                                                TN, TK, BR, GROUP_N, SORTED)
        for half in gl.static_range(2):
            for step in range(steps):
                r0 = RAGGED - row_end + row0 + step * BR
                if half == 0:
                    dy_it = _load(dy_desc, dy_bufs, dy_ready, dy_empty, dy_it, [RAGGED, row_end, r0, n0])
                elif steps > DY_STAGES:  # a pair that does not share: consumer 1's own dy blocks
                    dy_it = _load(dy_desc, dy_bufs, dy_ready, dy_empty, dy_it, [RAGGED, row_end, r0, n0])
                x_it = _load(x_desc, x_bufs, x_ready, x_empty, x_it, [RAGGED, row_end, r0, k0 + half * TK])


@gluon.jit
def _load(desc, bufs, ready, empty, it, coords):
    """One TMA load into ring slot it % STAGES once the slot is free; returns it + 1."""
    STAGES: gl.constexpr = bufs.type.shape[0]
    s = it % STAGES
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1: the rings start empty
    mbarrier.expect(ready.index(s), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, coords, ready.index(s), bufs.index(s))
    return it + 1


@gluon.jit
def _consumer(dw_desc, dy_bufs, x_bufs, out_bufs, dy_ready, dy_empty, x_ready, x_empty, turn, offs_ptr, sched_ptr, M,
              tiles_n, pairs_k, total, NUM_PROGS, ROLE: gl.constexpr, TN: gl.constexpr, TK: gl.constexpr,
              BR: gl.constexpr, GROUP_N: gl.constexpr, SORTED: gl.constexpr):
    DY_STAGES: gl.constexpr = dy_bufs.type.shape[0]
    X_STAGES: gl.constexpr = x_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TK, 16])
    out = out_bufs.index(ROLE).reshape([TN, TK])
    dy_it = 0
    x_it = 0
    turn_phase = 1 - ROLE  # consumer 0 goes first (a fresh barrier passes phase 1); 1 waits for 0's first turn
    for pair in range(gl.program_id(0), total, NUM_PROGS):
        g, n0, k0, row0, row_end, steps = _pair(pair, offs_ptr, sched_ptr, M, tiles_n, pairs_k, total, NUM_PROGS,
                                                TN, TK, BR, GROUP_N, SORTED)
        # this consumer's first dy and x blocks in ring order (consumer 0's steps come first in both rings)
        dy0 = dy_it
        x0 = x_it + ROLE * steps
        if steps > DY_STAGES:  # a pair that does not share dy: consumer 1's own blocks follow consumer 0's
            dy0 += ROLE * steps
        # who frees this consumer's dy blocks: itself, unless the pair shares them and it is consumer 0
        if ROLE == 1:
            frees_dy = steps > 0
        else:
            frees_dy = steps > DY_STAGES
        mbarrier.wait(turn.index(ROLE), turn_phase)
        turn_phase ^= 1
        acc = gl.zeros((TN, TK), dtype=gl.float32, layout=acc_layout)
        for step in range(steps):
            ds = (dy0 + step) % DY_STAGES
            xs = (x0 + step) % X_STAGES
            mbarrier.wait(dy_ready.index(ds), ((dy0 + step) // DY_STAGES) & 1)
            mbarrier.wait(x_ready.index(xs), ((x0 + step) // X_STAGES) & 1)
            a = dy_bufs.index(ds).reshape([BR, TN]).permute((1, 0))  # dy_g^T block [TN, BR]
            b = x_bufs.index(xs).reshape([BR, TK])  # x_g block [BR, TK]
            acc = warpgroup_mma(a, b, acc, use_acc=step > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if step > 0:  # the previous step's MMA is done: its blocks can be refilled
                mbarrier.arrive(x_empty.index((x0 + step - 1) % X_STAGES), count=1)
                if frees_dy:
                    mbarrier.arrive(dy_empty.index((dy0 + step - 1) % DY_STAGES), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(x_empty.index((x0 + steps - 1) % X_STAGES), count=1)
        if frees_dy:
            mbarrier.arrive(dy_empty.index((dy0 + steps - 1) % DY_STAGES), count=1)
        mbarrier.arrive(turn.index(1 - ROLE), count=1)  # the other consumer's MMAs run under this epilogue
        tma.store_wait(pendings=0)  # this consumer's previous tile has left its store buffer
        out.store(acc.to(dw_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dw_desc, [g, n0, k0 + ROLE * TK], out_bufs.index(ROLE))
        dy_it += steps
        if steps > DY_STAGES:
            dy_it += steps
        x_it += 2 * steps
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["M", "G", "NUM_PROGS"])
def _wgrad_pairs_kernel(dy_desc, x_desc, dw_desc, offs_ptr, sched_ptr, M, N, K, G, NUM_PROGS, X_STAGES: gl.constexpr,
                        DY_STAGES: gl.constexpr, GROUP_N: gl.constexpr, SORTED: gl.constexpr, RAGGED: gl.constexpr,
                        num_warps: gl.constexpr):
    """SORTED: sched_ptr [G + 1] int32 (schedule.skew_schedule); else unused."""
    TN: gl.constexpr = dw_desc.block_type.shape[1]
    TK: gl.constexpr = dw_desc.block_type.shape[2]
    BR: gl.constexpr = dy_desc.block_type.shape[2]
    tiles_n = (N + TN - 1) // TN
    pairs_k = (K + 2 * TK - 1) // (2 * TK)
    total = G * tiles_n * pairs_k
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [DY_STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [X_STAGES] + x_desc.block_type.shape, x_desc.layout)
    out_bufs = gl.allocate_shared_memory(dw_desc.dtype, [2] + dw_desc.block_type.shape, dw_desc.layout)
    dy_ready = gl.allocate_shared_memory(gl.int64, [DY_STAGES, 1], mbarrier.MBarrierLayout())
    dy_empty = gl.allocate_shared_memory(gl.int64, [DY_STAGES, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [X_STAGES, 1], mbarrier.MBarrierLayout())
    x_empty = gl.allocate_shared_memory(gl.int64, [X_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DY_STAGES):
        mbarrier.init(dy_ready.index(i), count=1)
        mbarrier.init(dy_empty.index(i), count=1)
    for i in gl.static_range(X_STAGES):
        mbarrier.init(x_ready.index(i), count=1)
        mbarrier.init(x_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (dw_desc, dy_bufs, x_bufs, out_bufs, dy_ready, dy_empty, x_ready, x_empty, turn, offs_ptr,
                     sched_ptr, M, tiles_n, pairs_k, total, NUM_PROGS, 0, TN, TK, BR, GROUP_N, SORTED)),
        (_consumer, (dw_desc, dy_bufs, x_bufs, out_bufs, dy_ready, dy_empty, x_ready, x_empty, turn, offs_ptr,
                     sched_ptr, M, tiles_n, pairs_k, total, NUM_PROGS, 1, TN, TK, BR, GROUP_N, SORTED)),
        (_producer, (dy_desc, x_desc, dy_bufs, x_bufs, dy_ready, dy_empty, x_ready, x_empty, offs_ptr, sched_ptr, M,
                     tiles_n, pairs_k, total, NUM_PROGS, TN, TK, BR, GROUP_N, SORTED, RAGGED)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


MAXNREG = 168  # registers per thread at launch (the file over three warpgroups' slots); setmaxnreg shares them out


def grouped_gemm_wgrad_pairs(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, *,
                             x_stages: int, dy_stages: int, group_n: int, num_programs: int | None = None,
                             sorted_groups: bool = False) -> torch.Tensor:
    """dw [G, N, K] into ``out`` (the module docstring): dy [M, N], x [M, K] bf16 contiguous on a Hopper GPU, N and K
    multiples of 8, offs [G] int32 contiguous, out [G, N, K] bf16. Checked by its caller,
    wgrad_pingpong.grouped_gemm_wgrad_pingpong (dy_stages=)."""
    if dy_stages not in DY_STAGE_CHOICES:
        raise ValueError(f"grouped_gemm_wgrad_pairs: dy_stages={dy_stages} is not one of {DY_STAGE_CHOICES}")
    M, N = dy.shape
    K, G = x.shape[1], offs.shape[0]
    dw_desc = descriptor(out, [G, N, K], [N * K, K, 1], [1, TILE, TILE])
    total = G * cdiv(N, TILE) * cdiv(K, 2 * TILE)
    nprog = max(1, min(num_programs or cuda_device.sm_count(dy.device), total))
    with cuda_device.on_device(dy.device):
        sched = skew_schedule(offs) if sorted_groups else offs  # (unused without SORTED)
        _wgrad_pairs_kernel[(nprog,)](
            ragged_desc(dy, [BLOCK_R, TILE]), ragged_desc(x, [BLOCK_R, TILE]), dw_desc, offs, sched, M, N, K, G, nprog,
            X_STAGES=x_stages, DY_STAGES=dy_stages, GROUP_N=group_n, SORTED=sorted_groups, RAGGED=RAGGED_ROWS,
            num_warps=4, maxnreg=MAXNREG)
    return out


def aot_compile(x_stages: int = 4, dy_stages: int = 6, group_n: int = 8, capability: int = 90,
                sorted_groups: bool = False):
    """Compile the kernel for sm_``capability`` without a GPU (the CPU tests' resource checks); returns the triton
    CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block = aot_type([1, 1, BLOCK_R, TILE])
    sig = {"dy_desc": block, "x_desc": block, "dw_desc": aot_type([1, TILE, TILE]), "offs_ptr": "*i32",
           "sched_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "G": "i32", "NUM_PROGS": "i32",
           "X_STAGES": "constexpr", "DY_STAGES": "constexpr", "GROUP_N": "constexpr", "SORTED": "constexpr",
           "RAGGED": "constexpr", "num_warps": "constexpr"}
    names = list(sig)
    src = GluonASTSource(_wgrad_pairs_kernel, sig,
                         constexprs={"X_STAGES": x_stages, "DY_STAGES": dy_stages, "GROUP_N": group_n,
                                     "SORTED": sorted_groups, "RAGGED": RAGGED_ROWS, "num_warps": 4},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ("offs_ptr", "sched_ptr")})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": 4, "maxnreg": MAXNREG})
