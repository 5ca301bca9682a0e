"""Forward and data gradient of the grouped GEMM as a warp-specialized ping-pong kernel (Gluon, Hopper).

Legend as in grouped_gemm.py: M grouped rows, G groups, w [G, N, K], offs [G] int32 cumulative row ends.

    forward  y  [M, N] = x_g @ w[g]^T    (x [M, K])
    dgrad    dx [M, K] = dy_g @ w[g]     (dy [M, N])

bf16 in, fp32 accumulation, bf16 out; rows past offs[-1] belong to no group and are written as zeros.

Why: our Triton forward / data gradient (grouped_gemm_kernels._rowgroup_kernel) and torch._grouped_mm both run at
~560-620 TFLOP/s on the layers' routed shapes (bench/grouped_gemm.md), against 690-790 for a dense GEMM on the same
H200.
In the Triton kernel the same warps issue the TMA loads, the MMAs and the epilogue, so each tile's epilogue stalls
the tensor cores; at Qwen3's FC2 (12 reduction steps per tile) that is a large share. The weight gradient's
ping-pong (wgrad_pingpong.py) removed exactly this stall there (1.1-1.2x). Here the same schedule:
- a producer warp issues every TMA load (the A rows, the expert's w block) into a ring of STAGES stages;
- two consumer warpgroups own whole output tiles alternately and take turns at the tensor cores, so one's epilogue
  (convert, shared store, TMA store) runs under the other's MMAs.
Tiles: group g owns cdiv(rows_g, BM) row tiles times the output column tiles; group-major; inside a group, bands of
GROUP_M row tiles with the column tiles outer (the programs at work at once share w's blocks in L2). The programs
find their tiles' groups without a host sync: each partition walks a cursor over offs (a program's tiles only move
forward), and the tile total comes from one vector reduction before the partitions split. The rows past offs[-1]
form one more pseudo-group whose tiles store zeros without loading anything.
Loads: A through a 2-D descriptor (rows past the group's end only feed output rows that are dropped), w through a
3-D [G, N, K] one (zero fill stays inside the expert). Stores: the "ragged" 4-D descriptor (grouped_gemm_kernels
RAGGED), which drops rows at or past the group's end in hardware.

Measured on the H200 (bench/grouped_gemm.md; the sums per shape: bench/archive/2026-11-29_2114-2254.md): level with
torch._grouped_mm on the sums of the forward / data gradient GEMMs at Qwen3, GPT-OSS and Mixtral (0.999-1.010x),
0.94x at DeepSeek-V3; up to 1.05x on single ops. The autotuner offers it
(grouped_gemm_configs.PINGPONG_ROWGROUP_CONFIGS) and keeps it where it wins.

Two fused epilogues (the EPILOGUE constexpr; their code is pingpong_epilogues.py):
- SWIGLU_FWD, grouped_gemm_fc1_swiglu_pingpong, called by the layer (moe_fused.fc1_swiglu, where auto measures it
  faster): FC1's forward writes h and a = SwiGLU(h) * probs. Each stage loads the gate rows and the up rows of 64
  columns of a into one 128-row w block, so each thread's accumulator holds g and u of the same elements and the
  activation runs in registers; the separate SwiGLU kernel's read of h [M, 2I] goes away. On the H200: 1.02-1.14x the
  best separate path (FC1 GEMM + SwiGLU kernel) at Qwen3, GPT-OSS and Mixtral, 0.98x at DeepSeek-V3.
- SWIGLU_BWD, grouped_gemm_dgrad_swiglu_pingpong, not called by the layer: FC2's data gradient with
  SwiGLU's backward. Correct. Its epilogue (da converted to 16-byte rows per thread, g and u loaded and dh
  stored from registers, each consumer on its own) runs 0.68x the best separate pair at Qwen3, 0.77x at GPT-OSS,
  0.94-0.98x at Mixtral and DeepSeek-V3 (a variant with shared buffers passed between the consumers: 0.57x at
  Qwen3): per tile it still takes ~2x a Qwen3 tile's main loop. Branch next/swiglu-bwd-prefetch loads a quarter
  tile's g and u at once (four memory round trips per tile instead of eight): 0.73x at Qwen3, 0.77x at GPT-OSS,
  so the round trips are part of the cost, not all of it. Shelved: even a free epilogue would save only
  da's write and read (~0.1 ms per layer at Qwen3).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from moetrain.runtime import cuda_device
from moetrain.kernels.gluon_descs import aot_type, descriptor, ragged_desc
from moetrain.kernels.grouped_gemm_kernels import RAGGED_ROWS
from moetrain.kernels.host import next_pow2
from moetrain.kernels.launch import launch
from moetrain.kernels.moe_rows import ACTIVATIONS
from moetrain.kernels.pingpong_epilogues import swiglu_bwd_epilogue, swiglu_fwd_epilogue

BLOCK_K = 64  # reduction step
TILES = ((128, 128), (64, 256))  # a consumer's output tile (rows, columns): a 128-register fp32 accumulator either way
# The epilogue a launch runs on each output tile (the kernel's EPILOGUE constexpr).
PLAIN = gl.constexpr(0)  # store the tile
SWIGLU_BWD = gl.constexpr(1)  # data gradient only: SwiGLU's backward (grouped_gemm_dgrad_swiglu_pingpong)
SWIGLU_FWD = gl.constexpr(2)  # forward only: FC1 with SwiGLU (grouped_gemm_fc1_swiglu_pingpong)
PRODUCER_REGS = gl.constexpr(40)  # registers per thread of the producer warp (setmaxnreg)
CONSUMER_REGS = gl.constexpr(232)  # per thread of each consumer warpgroup


@gluon.jit
def _advance(tile, g, g_end, row0, row_end, offs_ptr, M, G, n_tiles, BM: gl.constexpr):
    """Moves the group cursor (g, its last tile + 1, its rows [row0, row_end)) forward to the group owning ``tile``.
    Group G is the rows past offs[-1]. Each group's row range is clamped as in the tile total (_tile_total), so the
    two agree on every input."""
    while (tile >= g_end) & (g < G):
        g += 1
        start = gl.load(offs_ptr + gl.maximum(g - 1, 0))
        start = gl.where(g > 0, gl.minimum(gl.maximum(start, 0), M), 0)
        end = gl.load(offs_ptr + gl.minimum(g, G - 1))
        end = gl.where(g < G, gl.minimum(gl.maximum(end, 0), M), M)
        row0 = start
        row_end = gl.maximum(end, start)
        g_end = g_end + (row_end - row0 + BM - 1) // BM * n_tiles
    return g, g_end, row0, row_end


@gluon.jit
def _coords(tile, g_end, row0, row_end, n_tiles, BM: gl.constexpr, TN: gl.constexpr, GROUP_M: gl.constexpr):
    """(first row, first column) of ``tile`` in its group: bands of GROUP_M row tiles, column tiles outer."""
    m_tiles = (row_end - row0 + BM - 1) // BM
    local = tile - (g_end - m_tiles * n_tiles)
    band = local // (GROUP_M * n_tiles)
    first_m = band * GROUP_M
    band_m = gl.minimum(m_tiles - first_m, GROUP_M)
    r = local - band * (GROUP_M * n_tiles)
    return row0 + (first_m + r % band_m) * BM, (r // band_m) * TN


@gluon.jit
def _producer(a_desc, w_desc, a_bufs, w_bufs, ready, empty, offs_ptr, M, OUT, G, n_tiles, k_tiles, total, NUM_PROGS,
              BM: gl.constexpr, CN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, DGRAD: gl.constexpr,
              EPILOGUE: gl.constexpr):
    """TMA loads of each step's A block [BM, BK] and w block ([TN, BK] forward, [BK, TN] data gradient; SWIGLU_FWD:
    the gate rows n0.. and the up rows OUT + n0.. of expert g, CN each, from w viewed as [G * 2 * OUT, K])."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    g = -1
    g_end = 0
    row0 = 0
    row_end = 0
    it = 0
    for tile in range(gl.program_id(0), total, NUM_PROGS):
        g, g_end, row0, row_end = _advance(tile, g, g_end, row0, row_end, offs_ptr, M, G, n_tiles, BM)
        if g < G:  # (the pseudo-group past offs[-1] loads nothing)
            m0, n0 = _coords(tile, g_end, row0, row_end, n_tiles, BM, CN, GROUP_M)
            for step in range(k_tiles):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1: ring empty
                k0 = step * BK
                if EPILOGUE == SWIGLU_FWD:
                    # Past OUT the gate box reads up rows and the up box the next expert's: they only feed output
                    # columns >= OUT, which the stores drop.
                    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(a_desc, [m0, k0], ready.index(s), a_bufs.index(s))
                    first = g * 2 * OUT + n0
                    tma.async_copy_global_to_shared(w_desc, [first, k0], ready.index(s),
                                                    w_bufs.index(s).slice(0, CN))
                    tma.async_copy_global_to_shared(w_desc, [first + OUT, k0], ready.index(s),
                                                    w_bufs.index(s).slice(CN, CN))
                else:
                    mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(a_desc, [m0, k0], ready.index(s), a_bufs.index(s))
                    if DGRAD:
                        tma.async_copy_global_to_shared(w_desc, [g, k0, n0], ready.index(s), w_bufs.index(s))
                    else:
                        tma.async_copy_global_to_shared(w_desc, [g, n0, k0], ready.index(s), w_bufs.index(s))
                it += 1


@gluon.jit
def _consumer(out_desc, a_bufs, w_bufs, out_bufs, ready, empty, turn, h_desc, h_up_desc, h_ptr, dh_ptr, probs_ptr,
              parts_ptr, offs_ptr, M, OUT, G, n_tiles, k_tiles, total, NUM_PROGS, ROLE: gl.constexpr,
              BM: gl.constexpr, TN: gl.constexpr, CN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
              DGRAD: gl.constexpr, RAGGED: gl.constexpr, EPILOGUE: gl.constexpr, ACT: gl.constexpr,
              HAS_PROBS: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TN, 16])
    g = -1
    g_end = 0
    row0 = 0
    row_end = 0
    it = 0
    j = 0
    turn_phase = 1 - ROLE  # warpgroup 0 goes first (a fresh barrier passes phase 1); 1 waits for 0's first turn
    for tile in range(gl.program_id(0), total, NUM_PROGS):
        g, g_end, row0, row_end = _advance(tile, g, g_end, row0, row_end, offs_ptr, M, G, n_tiles, BM)
        steps = gl.where(g < G, k_tiles, 0)  # the pseudo-group past offs[-1]: zeros, no MMA
        if j % 2 == ROLE:
            mbarrier.wait(turn.index(ROLE), turn_phase)
            turn_phase ^= 1
            acc = gl.zeros((BM, TN), dtype=gl.float32, layout=acc_layout)
            for step in range(steps):
                s = (it + step) % STAGES
                mbarrier.wait(ready.index(s), ((it + step) // STAGES) & 1)
                a = a_bufs.index(s)  # [BM, BK]
                if EPILOGUE == SWIGLU_FWD:
                    b = w_bufs.index(s).permute((1, 0))  # [TN, BK]: gate rows then up rows
                elif DGRAD:
                    b = w_bufs.index(s).reshape([BK, TN])
                else:
                    b = w_bufs.index(s).reshape([TN, BK]).permute((1, 0))
                acc = warpgroup_mma(a, b, acc, use_acc=step > 0, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if step > 0:  # the previous step's MMA is done: its stage can be refilled
                    mbarrier.arrive(empty.index((it + step - 1) % STAGES), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if steps > 0:
                mbarrier.arrive(empty.index((it + steps - 1) % STAGES), count=1)
            mbarrier.arrive(turn.index(1 - ROLE), count=1)  # the other warpgroup's MMAs run under this epilogue
            m0, n0 = _coords(tile, g_end, row0, row_end, n_tiles, BM, CN, GROUP_M)
            if EPILOGUE == SWIGLU_BWD:
                swiglu_bwd_epilogue(acc, h_ptr, dh_ptr, probs_ptr, parts_ptr, m0, n0, row_end, OUT, n_tiles, BM, TN,
                                     ACT, HAS_PROBS)
            elif EPILOGUE == SWIGLU_FWD:
                swiglu_fwd_epilogue(acc, out_bufs, ROLE, out_desc, h_desc, h_up_desc, probs_ptr, m0, n0, row_end, BM,
                                     CN, ACT, HAS_PROBS, RAGGED)
            else:
                tma.store_wait(pendings=0)  # this warpgroup's previous tile has left its store buffer
                out_bufs.index(ROLE).reshape([BM, TN]).store(acc.to(out_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(out_desc, [RAGGED, row_end, RAGGED - row_end + m0, n0],
                                                out_bufs.index(ROLE))
        it += steps
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _tile_total(offs_ptr, M, G, n_tiles, BM: gl.constexpr, BLOCK_G: gl.constexpr):
    """The launch's tile count: every group's row tiles (rows clamped as in _advance) plus the rows past offs[-1],
    times the column tiles."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    gi = gl.arange(0, BLOCK_G, layout=layout)
    ends = gl.load(offs_ptr + gl.minimum(gi, G - 1))
    ends = gl.where(gi < G, gl.minimum(gl.maximum(ends, 0), M), M)  # slot G: the rows past offs[-1]
    starts = gl.load(offs_ptr + gl.minimum(gl.maximum(gi - 1, 0), G - 1))
    starts = gl.where(gi > 0, gl.minimum(gl.maximum(starts, 0), M), 0)
    rows = gl.where(gi <= G, gl.maximum(ends, starts) - starts, 0)
    return gl.sum((rows + BM - 1) // BM, axis=0) * n_tiles


@gluon.jit(do_not_specialize=["M", "G", "NUM_PROGS"])
def _rowgroup_pingpong_kernel(a_desc, w_desc, out_desc, h_desc, h_up_desc, h_ptr, dh_ptr, probs_ptr, parts_ptr,
                              offs_ptr, M, OUT, RED, G,
                              NUM_PROGS, STAGES: gl.constexpr, GROUP_M: gl.constexpr, DGRAD: gl.constexpr,
                              BLOCK_G: gl.constexpr, RAGGED: gl.constexpr, EPILOGUE: gl.constexpr, ACT: gl.constexpr,
                              HAS_PROBS: gl.constexpr, num_warps: gl.constexpr):
    """a_desc: A [M, RED] (x or dy), block [BM, BK]; w_desc: w [G, N, K], block [1, TN, BK] (forward) or [1, BK, TN]
    (DGRAD); out_desc: out [M, OUT] ragged, block [1, 1, BM, TN].
    SWIGLU_BWD (with DGRAD): h_ptr / dh_ptr are h and dh [M, 2I] (gate columns, then up); out_desc is dh's gate half
    as a ragged [M, I] (its block gives the tile); probs_ptr [M] fp32 and parts_ptr [M, n_tiles] fp32 with HAS_PROBS.
    SWIGLU_FWD (forward): w_desc is FC1's w [G, 2 OUT, K] viewed as [G * 2 OUT, K], block [TN / 2, BK]; out_desc is
    a [M, OUT] ragged, block [1, 1, BM, TN / 2]; h_desc / h_up_desc the halves of h [M, 2 OUT] (outputs here);
    probs_ptr [M] fp32 with HAS_PROBS.
    Unused descriptors and pointers may be any of the others."""
    BM: gl.constexpr = out_desc.block_type.shape[2]
    CN: gl.constexpr = out_desc.block_type.shape[3]  # output columns per tile (of a, with SWIGLU_FWD)
    TN: gl.constexpr = 2 * CN if EPILOGUE == SWIGLU_FWD else CN  # accumulator columns
    BK: gl.constexpr = a_desc.block_type.shape[1]
    n_tiles = (OUT + CN - 1) // CN
    k_tiles = (RED + BK - 1) // BK
    total = _tile_total(offs_ptr, M, G, n_tiles, BM, BLOCK_G)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    if EPILOGUE == SWIGLU_FWD:  # each stage: the gate box, then the up box
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, TN, BK], w_desc.layout)
    else:
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    if EPILOGUE == SWIGLU_BWD:  # none: the epilogue's layout conversion has its own scratch (a placeholder)
        out_bufs = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    elif EPILOGUE == SWIGLU_FWD:  # (g then a, u) per consumer
        out_bufs = gl.allocate_shared_memory(h_desc.dtype, [4] + h_desc.block_type.shape, h_desc.layout)
    else:  # one store buffer per consumer
        out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    # (spelled out as in wgrad_pingpong.py: argument tuples held in variables lose their constexprs)
    gl.warp_specialize([
        (_consumer, (out_desc, a_bufs, w_bufs, out_bufs, ready, empty, turn, h_desc, h_up_desc, h_ptr, dh_ptr,
                     probs_ptr, parts_ptr, offs_ptr, M, OUT, G, n_tiles, k_tiles, total, NUM_PROGS, 0, BM, TN, CN, BK,
                     GROUP_M, DGRAD, RAGGED, EPILOGUE, ACT, HAS_PROBS)),
        (_consumer, (out_desc, a_bufs, w_bufs, out_bufs, ready, empty, turn, h_desc, h_up_desc, h_ptr, dh_ptr,
                     probs_ptr, parts_ptr, offs_ptr, M, OUT, G, n_tiles, k_tiles, total, NUM_PROGS, 1, BM, TN, CN, BK,
                     GROUP_M, DGRAD, RAGGED, EPILOGUE, ACT, HAS_PROBS)),
        (_producer, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, offs_ptr, M, OUT, G, n_tiles, k_tiles, total,
                     NUM_PROGS, BM, CN, BK, GROUP_M, DGRAD, EPILOGUE)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _descs(a: torch.Tensor, w: torch.Tensor, tile: tuple[int, int], dgrad: bool):
    bm, tn = tile
    a_block = [bm, BLOCK_K]
    w_block = [1, BLOCK_K, tn] if dgrad else [1, tn, BLOCK_K]
    g, n, k = w.shape
    return (descriptor(a, list(a.shape), [a.stride(0), 1], a_block), descriptor(w, [g, n, k], [n * k, k, 1], w_block))


def _ragged_halves(t: torch.Tensor, block: list):
    """Ragged descriptors of t [M, 2I]'s gate half t[:, :I] and up half t[:, I:] (views with row stride 2I; the
    up half's base is 2I bytes in, 16-byte aligned as I is a multiple of 8)."""
    inter = t.shape[1] // 2
    return ragged_desc(t[:, :inter], block), ragged_desc(t[:, inter:], block)


def _block_g(groups: int) -> int:
    return max(256, next_pow2(groups + 1))  # slot G: the rows past offs[-1]; one compile up to 255 groups


def _check(name: str, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dgrad: bool, tile) -> None:
    if a.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or a.device.type != "cuda":
        raise ValueError(f"{name}: bf16 CUDA tensors only (a Hopper kernel)")
    if a.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or offs.shape[0] != w.shape[0]:
        raise ValueError(f"{name}: a {tuple(a.shape)}, w {tuple(w.shape)}, offs {tuple(offs.shape)} must be [M, RED], "
                         "[G, N, K], [G]")
    G, N, K = w.shape
    red = N if dgrad else K
    if a.shape[1] != red:
        raise ValueError(f"{name}: a has {a.shape[1]} columns; {'dgrad' if dgrad else 'forward'} with w "
                         f"{tuple(w.shape)} reduces over {red}")
    if tuple(tile) not in TILES:
        raise ValueError(f"{name}: tile {tile} is not one of {TILES}")
    if cuda_device.capability_major(a.device) != 9:
        raise ValueError(f"{name}: Hopper (sm_90) only")
    if (N * 2) % 16 or (K * 2) % 16:
        raise ValueError(f"{name}: N={N} and K={K} must be multiples of 8 (16-byte TMA rows)")
    if a.shape[0] >= RAGGED_ROWS:
        raise ValueError(f"{name}: M={a.shape[0]} rows must be < 2^30 (ragged descriptors)")
    if next_pow2(G + 1) > 1024:
        raise ValueError(f"{name}: {G} groups: at most 1023")


def _value(epilogue) -> int:
    """PLAIN / SWIGLU_BWD / SWIGLU_FWD (constexprs, for the kernel's comparisons) as the int a launch takes."""
    return int(getattr(epilogue, "value", epilogue))


def _launch(a, offs, groups: int, width: int, a_desc, w_desc, out_desc, *, dgrad: bool, stages: int, group_m: int,
            num_programs: int | None, h_descs=None, h=None, dh=None, probs=None, parts=None, epilogue: int = PLAIN,
            act: int = 0):
    """width: the output columns the tiles cover (OUT: N or K; I with SWIGLU_BWD / SWIGLU_FWD). The kernel's unused
    descriptors and pointers get out_desc and offs."""
    nprog = max(1, num_programs or cuda_device.sm_count(a.device))
    h_descs = h_descs or (out_desc, out_desc)
    with cuda_device.on_device(a.device):
        launch(_rowgroup_pingpong_kernel, (nprog,),
            a_desc, w_desc, out_desc, *h_descs, *(t if t is not None else offs for t in (h, dh, probs, parts)), offs,
            a.shape[0], width, a.shape[1], groups, nprog, STAGES=stages, GROUP_M=group_m, DGRAD=dgrad,
            BLOCK_G=_block_g(groups), RAGGED=RAGGED_ROWS, EPILOGUE=_value(epilogue), ACT=act,
            HAS_PROBS=probs is not None, num_warps=4, maxnreg=168)


def grouped_gemm_rowgroup_pingpong(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, dgrad: bool = False,
                                   stages: int = 4, group_m: int = 8, tile: tuple[int, int] = (128, 128),
                                   out: torch.Tensor | None = None, num_programs: int | None = None) -> torch.Tensor:
    """Forward (y [M, N] = x_g @ w[g]^T, a = x [M, K]) or, with ``dgrad``, data gradient (dx [M, K] = dy_g @ w[g],
    a = dy [M, N]) per group; w [G, N, K]; offs [G] int32; rows past offs[-1] are zeros. bf16 contiguous tensors on
    a Hopper GPU, N and K multiples of 8 (16-byte TMA rows). ``tile``: each consumer's output tile, (128, 128) or
    (64, 256). ``group_m``: row tiles per band. Called by grouped_gemm_fwd / _dgrad for the "pingpong" configs."""
    _check("grouped_gemm_rowgroup_pingpong", a, w, offs, dgrad, tile)
    a, w = a.contiguous(), w.contiguous()
    offs = offs.to(torch.int32).contiguous()
    M, width = a.shape[0], w.shape[2] if dgrad else w.shape[1]
    if out is None:
        out = torch.empty(M, width, dtype=a.dtype, device=a.device)
    elif tuple(out.shape) != (M, width) or out.dtype != a.dtype or not out.is_contiguous() or out.device != a.device:
        raise ValueError(f"grouped_gemm_rowgroup_pingpong: out must be a contiguous {a.dtype} [{M}, {width}] tensor on "
                         f"{a.device} (got {tuple(out.shape)} {out.dtype})")
    if M == 0 or width == 0:
        return out
    if w.shape[0] == 0:
        return out.zero_()
    a_desc, w_desc = _descs(a, w, tile, dgrad)
    out_desc = ragged_desc(out, list(tile))
    _launch(a, offs, w.shape[0], width, a_desc, w_desc, out_desc, dgrad=dgrad, stages=stages, group_m=group_m,
            num_programs=num_programs)
    return out


def grouped_gemm_dgrad_swiglu_pingpong(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, h: torch.Tensor,
                                       probs: torch.Tensor | None = None, activation: str = "swiglu", *,
                                       stages: int = 5, group_m: int = 8, num_programs: int | None = None):
    """FC2's data gradient with SwiGLU's backward in its epilogue: da = dy_g @ w[g] per group (dy [M, H], w [G, H, I]),
    never written; from it and h [M, 2I] (FC1's output, gate columns then up), as moe_rows.swiglu_bwd does from da:
    (dh [M, 2I] bf16, dprobs [M] fp32 or None), where a = act(h) * probs[:, None] was FC2's input. Rows past
    offs[-1] get dh = 0 and dprobs = 0. 128x128 tiles; stages <= 6 (the epilogue's layout conversion takes ~16 KB of
    shared memory)."""
    name = "grouped_gemm_dgrad_swiglu_pingpong"
    tile = (128, 128)
    _check(name, dy, w, offs, True, tile)
    M, inter = dy.shape[0], w.shape[2]
    if h.dtype != torch.bfloat16 or tuple(h.shape) != (M, 2 * inter) or h.device != dy.device:
        raise ValueError(f"{name}: h {tuple(h.shape)} {h.dtype} must be bf16 [M, 2I] = [{M}, {2 * inter}]")
    _check_probs_activation(name, probs, M, activation)
    if stages > 6:
        raise ValueError(f"{name}: stages={stages}: at most 6 fit beside the epilogue's scratch")
    dy, w, h = dy.contiguous(), w.contiguous(), h.contiguous()
    offs = offs.to(torch.int32).contiguous()
    dh = torch.empty_like(h)
    n_tiles = -(-inter // tile[1])
    parts = torch.empty(M, n_tiles, dtype=torch.float32, device=dy.device) if probs is not None else None
    if M == 0 or inter == 0:
        return dh, None if probs is None else torch.zeros_like(probs)
    if w.shape[0] == 0:
        return dh.zero_(), None if probs is None else torch.zeros_like(probs)
    a_desc, w_desc = _descs(dy, w, tile, True)
    _launch(dy, offs, w.shape[0], inter, a_desc, w_desc, _ragged_halves(dh, list(tile))[0], dgrad=True, stages=stages,
            group_m=group_m, num_programs=num_programs, h=h, dh=dh,
            probs=probs.contiguous() if probs is not None else None, parts=parts, epilogue=SWIGLU_BWD,
            act=ACTIVATIONS[activation])
    return dh, None if parts is None else parts.sum(dim=1)


def grouped_gemm_fc1_swiglu_pingpong(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                                     probs: torch.Tensor | None = None, activation: str = "swiglu", *,
                                     stages: int = 5, group_m: int = 8, num_programs: int | None = None):
    """FC1's forward with SwiGLU in its epilogue: h = x_g @ w[g]^T per group (x [M, H], w [G, 2I, H], gate rows then
    up rows) and a = act(h[:, :I], h[:, I:]) * probs[:, None] from h rounded to bf16, as moe_rows.swiglu_fwd computes
    it. Returns (h [M, 2I], a [M, I]), bf16; rows past offs[-1] are zeros in both. Each tile: 128 rows by 64 columns
    of a, from the gate and up rows of w at those columns (one 128-column accumulator); I a multiple of 8."""
    name = "grouped_gemm_fc1_swiglu_pingpong"
    tile = (128, 128)
    _check(name, x, w, offs, False, tile)
    M, inter = x.shape[0], w.shape[1] // 2
    if w.shape[1] % 16:
        raise ValueError(f"{name}: w {tuple(w.shape)} must be [G, 2I, H] with I a multiple of 8 (TMA-aligned halves)")
    _check_probs_activation(name, probs, M, activation)
    if stages > 5:
        raise ValueError(f"{name}: stages={stages}: at most 5 fit beside the epilogue's buffers")
    x, w = x.contiguous(), w.contiguous()
    offs = offs.to(torch.int32).contiguous()
    h = torch.empty(M, 2 * inter, dtype=x.dtype, device=x.device)
    a = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    if M == 0 or inter == 0:
        return h, a
    if w.shape[0] == 0:
        return h.zero_(), a.zero_()
    half = tile[1] // 2
    x_desc = descriptor(x, list(x.shape), [x.stride(0), 1], [tile[0], BLOCK_K])
    w_desc = descriptor(w, [w.shape[0] * w.shape[1], w.shape[2]], [w.shape[2], 1], [half, BLOCK_K])
    a_desc = ragged_desc(a, [tile[0], half])
    _launch(x, offs, w.shape[0], inter, x_desc, w_desc, a_desc, dgrad=False, stages=stages, group_m=group_m,
            num_programs=num_programs, h_descs=_ragged_halves(h, [tile[0], half]),
            probs=probs.contiguous() if probs is not None else None, epilogue=SWIGLU_FWD,
            act=ACTIVATIONS[activation])
    return h, a


def _check_probs_activation(name: str, probs: torch.Tensor | None, rows: int, activation: str) -> None:
    if probs is not None and (probs.dtype != torch.float32 or tuple(probs.shape) != (rows,)):
        raise ValueError(f"{name}: probs {tuple(probs.shape)} {probs.dtype} must be float32 [M] = [{rows}]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")


def aot_compile(stages: int = 4, tile: tuple[int, int] = (128, 128), dgrad: bool = False, epilogue: int = PLAIN,
                act: int = 0, has_probs: bool = True, capability: int = 90, group_m: int = 8):
    """Compile the kernel for sm_``capability`` without a GPU (the CPU tests' resource checks); returns the
    triton CompiledKernel. ``epilogue``: PLAIN, SWIGLU_BWD (a data gradient) or SWIGLU_FWD (a forward, 128x128)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, tn = tile
    dgrad = dgrad or epilogue == SWIGLU_BWD
    out = aot_type([1, 1, bm, tn // 2 if epilogue == SWIGLU_FWD else tn])
    if epilogue == SWIGLU_FWD:
        w_block = [tn // 2, BLOCK_K]
    else:
        w_block = [1, BLOCK_K, tn] if dgrad else [1, tn, BLOCK_K]
    sig = {"a_desc": aot_type([bm, BLOCK_K]), "w_desc": aot_type(w_block),
           "out_desc": out, "h_desc": out, "h_up_desc": out, "h_ptr": "*bf16", "dh_ptr": "*bf16", "probs_ptr": "*fp32",
           "parts_ptr": "*fp32", "offs_ptr": "*i32", "M": "i32",
           "OUT": "i32", "RED": "i32", "G": "i32", "NUM_PROGS": "i32", "STAGES": "constexpr", "GROUP_M": "constexpr",
           "DGRAD": "constexpr", "BLOCK_G": "constexpr", "RAGGED": "constexpr", "EPILOGUE": "constexpr",
           "ACT": "constexpr", "HAS_PROBS": "constexpr", "num_warps": "constexpr"}
    names = list(sig)
    src = GluonASTSource(_rowgroup_pingpong_kernel, sig,
                         constexprs={"STAGES": stages, "GROUP_M": group_m, "DGRAD": dgrad, "BLOCK_G": 256,
                                     "RAGGED": RAGGED_ROWS, "EPILOGUE": _value(epilogue), "ACT": act,
                                     "HAS_PROBS": has_probs,
                                     "num_warps": 4},
                         attrs={(names.index(n),): [["tt.divisibility", 16]]
                                for n in ("h_ptr", "dh_ptr", "probs_ptr", "parts_ptr", "offs_ptr", "OUT", "RED")})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4, "maxnreg": 168})
