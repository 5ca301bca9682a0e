"""Weight gradient of the grouped GEMM as a warp-specialized ping-pong kernel (Gluon, Hopper).

Legend as in grouped_gemm.py: M grouped rows, G groups, dy [M, N], x [M, K], offs [G] int32 cumulative row ends.

    dw [G, N, K] = dy_g^T @ x_g per group (bf16 in, fp32 accumulation, bf16 out; empty groups: zeros)

Why: under Nsight Compute our Triton weight gradient keeps the tensor pipe ~52% busy at DeepSeek-V3 (4 reduction
steps per 128x256 tile): the same warps issue the TMA loads, the MMAs and the epilogue, so the epilogue (26% of the
warp samples) and the TMA issue (17%) stall the MMAs (bench/archive/2026-11-29_1835-2000.md). Here:
- a producer warp issues every TMA load into a ring of STAGES stages (ready / empty mbarriers);
- two consumer warpgroups each own whole 128x128 dw tiles, alternately (tile j of this program goes to warpgroup
  j % 2), and take turns at the tensor cores (turn mbarriers): while one runs its epilogue (convert, shared store, TMA
  store) the other issues its MMAs. This is CUTLASS's "ping-pong" schedule.
Each consumer's fp32 accumulator is 128x128 (128 registers per thread); a 128x256 accumulator would not fit one
warpgroup. The price: 128x128 tiles read a third more operand bytes per FLOP than 128x256 ones.
Row ranges use the "ragged" 4-D TMA descriptors of grouped_gemm_kernels.py (loads past a group's end read zeros).
With gather_rows (FC1's weight gradient, x read from the token rows without the permuted copy) a fourth warpgroup
copies each step's x rows with cp.async, since Hopper's TMA cannot gather rows; its address arithmetic, which made
our Triton kernel's pointer-gathered operand ~0.7x as fast as TMA, runs beside the MMAs. A trial config (bench gemm,
not the autotuner): it is 1.3-1.8x slower than the permuted copy + this kernel (bench/grouped_gemm.md): one
warpgroup of copies cannot feed two of MMAs.
Tile order: group-major, every program on the same group at once. Schedules for skewed routing, where small groups'
one-step tiles are bound by their dw stores (_tile): COHORTS and MIX, trial configs only (bench gemm, not the
autotuner: slower than the plain order on balanced routing, bench/grouped_gemm.md), SORTED (groups heaviest first,
the light ones' tiles last, under the heavy ones' tail) an autotuner candidate (DeepSeek-V3's FC1 on skewed routing
9.78 -> 8.84 ms).

Measured on the H200 (bench/grouped_gemm.md): 1.1-1.2x our Triton weight gradient at DeepSeek-V3 and Qwen3
with bands (GROUP_N 8), about level at EP8's long reductions. grouped_gemm_wgrad offers it to the autotuner
(grouped_gemm_configs.PINGPONG_WGRAD_CONFIGS) where it applies: Hopper, bf16, TMA-aligned, rows not gathered.
Its speed depends on what the process ran before: after one launch of any two-programs-per-SM grouped GEMM config
it runs ~27% slower for a while (not explained), so those configs are not among the autotuner's candidates.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from moetrain.runtime import cuda_device
from moetrain.kernels.gluon_descs import aot_type, descriptor, ragged_desc
from moetrain.kernels.grouped_gemm_kernels import RAGGED_ROWS
from moetrain.kernels.host import cdiv
from moetrain.kernels.launch import launch
from moetrain.kernels.schedule import skew_schedule

BLOCK_N = 128  # dw tile rows (over N), by default
BLOCK_K = 128  # dw tile columns (over K), by default
TILES = ((128, 128), (64, 256))  # a consumer's dw tile: its fp32 accumulator is 128 registers per thread either way
BLOCK_R = 64  # reduction step: grouped rows per stage
COHORT_CHOICES = (1, 2, 4)  # _tile's cohorts of programs
PRODUCER_REGS = gl.constexpr(40)  # registers per thread of the producer warp (setmaxnreg)
CONSUMER_REGS = gl.constexpr(232)  # per thread of each consumer warpgroup (a 128x128 fp32 accumulator: 128)
# With x's rows gathered, a fourth warpgroup copies them (cp.async): the register file (512 per thread summed over
# the four warpgroups) is shared out again.
GATHER_CONSUMER_REGS = gl.constexpr(208)
GATHER_PRODUCER_REGS = gl.constexpr(24)
GATHERER_REGS = gl.constexpr(72)
GATHERER_WARPS = gl.constexpr(4)


@gluon.jit
def _tile(tile, offs_ptr, sched_ptr, M, tiles_n, tiles_k, total, NUM_PROGS, TN: gl.constexpr, TK: gl.constexpr,
          BR: gl.constexpr, GROUP_N: gl.constexpr, COHORTS: gl.constexpr, MIX: gl.constexpr, SORTED: gl.constexpr):
    """(group, first dw row n0, first dw column k0, the group's first row, its row end, reduction steps) of the
    program's tile ``tile`` (tile = program_id + j * NUM_PROGS: its j-th).
    Tiles are group-major; inside a group, bands of GROUP_N dw row tiles, column-major inside a band, so that the
    tiles running at once read GROUP_N column blocks of dy_g and a fraction of x_g's (as _wgrad_kernel's bands: a
    big group's rows do not fit in L2). An empty group still takes one step (its zero tile is stored).
    COHORTS > 1: the programs form COHORTS cohorts, cohort c starting its own tiles c / COHORTS of the way through
    (and wrapping round), so that the cohorts work on different groups at once: with skewed routing a small group's
    tiles (one step, then a 32 KB store: bound by HBM writes) overlap a big group's (many steps: bound by the tensor
    cores) instead of every program storing at once. Each program still computes the same tiles.
    MIX: the groups in the order sched_ptr[0:G] (heaviest first: schedule.skew_schedule), and where sched_ptr[G] is
    set (the routing is skewed), the second half of the programs walks its tiles backwards (light groups'
    store-bound tiles under heavy groups' MMA-bound ones, from the start) and odd rounds of tiles are dealt in
    reverse program order (each program gets as much work). Unset (near-balanced routing): every
    program in step, as without MIX, so the programs at work at once share one group's operands in L2.
    SORTED: the groups in the order sched_ptr[0:G] (heaviest first), every program in step: the light groups'
    store-bound tiles come last, where the programs that finished their heavy tiles early take them while others
    still run MMAs (the plain order leaves them among the heavy groups in expert order)."""
    if COHORTS > 1:
        pid = gl.program_id(0)
        count = (total - pid + NUM_PROGS - 1) // NUM_PROGS  # this program's tiles
        cohort = pid * COHORTS // NUM_PROGS
        j = ((tile - pid) // NUM_PROGS + cohort * (count // COHORTS)) % count
        tile = pid + j * NUM_PROGS
    per_group = tiles_n * tiles_k
    if MIX:
        pid = gl.program_id(0)
        count = (total - pid + NUM_PROGS - 1) // NUM_PROGS
        skewed = gl.load(sched_ptr + total // per_group) != 0
        j = (tile - pid) // NUM_PROGS
        j = gl.where(skewed & (pid * 2 >= NUM_PROGS), count - 1 - j, j)
        # odd full rounds dealt from the last program down ("snake"): with the heaviest groups first, it evens out
        # the programs' work (Qwen3's skewed weight gradient: the busiest program 7.5% over the mean, 1% with this)
        q = gl.where(skewed & (j % 2 == 1) & (j < total // NUM_PROGS), NUM_PROGS - 1 - pid, pid)
        tile = j * NUM_PROGS + q
    slot = tile // per_group
    local = tile - slot * per_group
    g = slot
    if MIX or SORTED:
        g = gl.load(sched_ptr + slot)
    band = GROUP_N * tiles_k
    first_n = (local // band) * GROUP_N
    band_rows = gl.minimum(tiles_n - first_n, GROUP_N)
    in_band = local - (local // band) * band
    n0 = (first_n + in_band % band_rows) * TN
    k0 = (in_band // band_rows) * TK
    row_end = gl.load(offs_ptr + g)
    row0 = gl.load(offs_ptr + gl.maximum(g - 1, 0))
    row0 = gl.where(g > 0, row0, 0)
    row0 = gl.minimum(gl.maximum(row0, 0), M)
    row_end = gl.maximum(gl.minimum(row_end, M), row0)
    steps = gl.maximum((row_end - row0 + BR - 1) // BR, 1)
    return g, n0, k0, row0, row_end, steps


@gluon.jit
def _producer(dy_desc, x_desc, dy_bufs, x_bufs, ready, empty, offs_ptr, sched_ptr, M, tiles_n, tiles_k, total,
              NUM_PROGS, TN: gl.constexpr, TK: gl.constexpr, BR: gl.constexpr, GROUP_N: gl.constexpr,
              COHORTS: gl.constexpr, MIX: gl.constexpr, SORTED: gl.constexpr, RAGGED: gl.constexpr,
              GATHER: gl.constexpr):
    """TMA loads of each step's dy block, and of its x block unless GATHER (then _gatherer copies x's rows)."""
    STAGES: gl.constexpr = dy_bufs.type.shape[0]
    it = 0
    for tile in range(gl.program_id(0), total, NUM_PROGS):
        g, n0, k0, row0, row_end, steps = _tile(tile, offs_ptr, sched_ptr, M, tiles_n, tiles_k, total, NUM_PROGS, TN,
                                                TK, BR, GROUP_N, COHORTS, MIX, SORTED)
        for step in range(steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1: the ring starts empty
            r0 = row0 + step * BR
            if GATHER:
                mbarrier.expect(ready.index(s), dy_desc.block_type.nbytes)
            else:
                mbarrier.expect(ready.index(s), dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [RAGGED, row_end, RAGGED - row_end + r0, k0], ready.index(s),
                                                x_bufs.index(s))
            tma.async_copy_global_to_shared(dy_desc, [RAGGED, row_end, RAGGED - row_end + r0, n0], ready.index(s),
                                            dy_bufs.index(s))
            it += 1


@gluon.jit
def _gatherer(x_ptr, gather_ptr, x_bufs, ready_x, empty, offs_ptr, sched_ptr, M, K, stride_xm, tiles_n, tiles_k, total,
              NUM_PROGS, TN: gl.constexpr, TK: gl.constexpr, BR: gl.constexpr, GROUP_N: gl.constexpr,
              COHORTS: gl.constexpr, MIX: gl.constexpr, SORTED: gl.constexpr):
    """GATHER: copies each step's x block, rows x[gather[r]] for the step's grouped rows r, with cp.async (Hopper's
    TMA cannot gather rows). Every thread arrives on ready_x once its own copies have landed (count: all threads);
    rows past the group's end are zero-filled (they meet dy's zero rows). K must be a multiple of TK."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    TPW_K: gl.constexpr = TK // 8  # threads along a row: 16-byte copies of 8 bf16
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // TPW_K, TPW_K],
                                            warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
    rows = gl.arange(0, BR, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, TK, layout=gl.SliceLayout(0, layout))
    it = 0
    for tile in range(gl.program_id(0), total, NUM_PROGS):
        g, n0, k0, row0, row_end, steps = _tile(tile, offs_ptr, sched_ptr, M, tiles_n, tiles_k, total, NUM_PROGS, TN,
                                                TK, BR, GROUP_N, COHORTS, MIX, SORTED)
        # 16-byte runs, one cp.async each; no column mask (it would split the copies into 2-byte ones): the
        # wrapper asks K to be a multiple of TK
        k_cols = gl.max_contiguous(gl.multiple_of(k0 + cols, 8), 8)
        for step in range(steps):
            s = it % STAGES
            r = row0 + step * BR + rows
            row_ok = r < row_end
            src = gl.load(gather_ptr + r, mask=row_ok, other=0)  # issued before the wait: its latency overlaps it
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            row_base = gl.multiple_of(src.to(gl.int64) * stride_xm, 8)  # stride_xm: a multiple of 8 (16-byte rows)
            ptrs = x_ptr + row_base[:, None] + k_cols[None, :]
            async_copy.async_copy_global_to_shared(x_bufs.index(s), ptrs, row_ok[:, None])  # past the end: zeros
            async_copy.mbarrier_arrive(ready_x.index(s), increment_count=False)
            it += 1


@gluon.jit
def _consumer(dw_desc, dy_bufs, x_bufs, out_bufs, ready, ready_x, empty, turn, offs_ptr, sched_ptr, M, tiles_n,
              tiles_k, total, NUM_PROGS, ROLE: gl.constexpr, TN: gl.constexpr, TK: gl.constexpr, BR: gl.constexpr,
              GROUP_N: gl.constexpr, COHORTS: gl.constexpr, MIX: gl.constexpr, SORTED: gl.constexpr,
              GATHER: gl.constexpr):
    STAGES: gl.constexpr = dy_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TK, 16])
    out = out_bufs.index(ROLE).reshape([TN, TK])
    it = 0
    j = 0
    turn_phase = 1 - ROLE  # warpgroup 0 goes first (a fresh barrier passes phase 1); 1 waits for 0's first turn
    for tile in range(gl.program_id(0), total, NUM_PROGS):
        g, n0, k0, row0, row_end, steps = _tile(tile, offs_ptr, sched_ptr, M, tiles_n, tiles_k, total, NUM_PROGS, TN,
                                                TK, BR, GROUP_N, COHORTS, MIX, SORTED)
        if j % 2 == ROLE:
            mbarrier.wait(turn.index(ROLE), turn_phase)
            turn_phase ^= 1
            acc = gl.zeros((TN, TK), dtype=gl.float32, layout=acc_layout)
            for step in range(steps):
                s = (it + step) % STAGES
                mbarrier.wait(ready.index(s), ((it + step) // STAGES) & 1)
                if GATHER:
                    mbarrier.wait(ready_x.index(s), ((it + step) // STAGES) & 1)
                    fence_async_shared()  # cp.async wrote x's rows through the generic proxy; wgmma reads the async one
                a = dy_bufs.index(s).reshape([BR, TN]).permute((1, 0))  # dy_g^T block [TN, BR]
                b = x_bufs.index(s).reshape([BR, TK])  # x_g block [BR, TK]
                acc = warpgroup_mma(a, b, acc, use_acc=step > 0, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if step > 0:  # the previous step's MMA is done: its stage can be refilled
                    mbarrier.arrive(empty.index((it + step - 1) % STAGES), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + steps - 1) % STAGES), count=1)
            mbarrier.arrive(turn.index(1 - ROLE), count=1)  # the other warpgroup's MMAs run under this epilogue
            tma.store_wait(pendings=0)  # this warpgroup's previous tile has left its store buffer
            out.store(acc.to(dw_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dw_desc, [g, n0, k0], out_bufs.index(ROLE))
        it += steps
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["M", "G", "NUM_PROGS"])
def _wgrad_pingpong_kernel(dy_desc, x_desc, x_ptr, gather_ptr, dw_desc, offs_ptr, sched_ptr, M, N, K, G, stride_xm,
                           NUM_PROGS, STAGES: gl.constexpr, GROUP_N: gl.constexpr, COHORTS: gl.constexpr,
                           MIX: gl.constexpr, SORTED: gl.constexpr, RAGGED: gl.constexpr, GATHER: gl.constexpr,
                           num_warps: gl.constexpr):
    """GATHER: x_ptr [T, K] token rows, gather_ptr [M] int32 (x_desc unused); else x_desc (x_ptr, gather_ptr unused).
    MIX or SORTED: sched_ptr [G + 1] int32 (schedule.skew_schedule); else unused."""
    TN: gl.constexpr = dw_desc.block_type.shape[1]
    TK: gl.constexpr = dw_desc.block_type.shape[2]
    BR: gl.constexpr = dy_desc.block_type.shape[2]
    tiles_n = (N + TN - 1) // TN
    tiles_k = (K + TK - 1) // TK
    total = G * tiles_n * tiles_k
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES] + dy_desc.block_type.shape, dy_desc.layout)
    if GATHER:
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, TK], gl.bfloat16)
        x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BR, TK], x_layout)
    else:
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    out_bufs = gl.allocate_shared_memory(dw_desc.dtype, [2] + dw_desc.block_type.shape, dw_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_x = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(ready_x.index(i), count=GATHERER_WARPS * 32)  # one cp.async arrival per gathering thread
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    # (the partition lists are spelled out: a jit function cannot be held in a variable, and argument tuples held in
    # variables lose their constexprs: TN and TK then reach reshape as tensors)
    if GATHER:
        gl.warp_specialize([
            (_consumer, (dw_desc, dy_bufs, x_bufs, out_bufs, ready, ready_x, empty, turn, offs_ptr, sched_ptr, M,
                         tiles_n, tiles_k, total, NUM_PROGS, 0, TN, TK, BR, GROUP_N, COHORTS, MIX, SORTED, GATHER)),
            (_consumer, (dw_desc, dy_bufs, x_bufs, out_bufs, ready, ready_x, empty, turn, offs_ptr, sched_ptr, M,
                         tiles_n, tiles_k, total, NUM_PROGS, 1, TN, TK, BR, GROUP_N, COHORTS, MIX, SORTED, GATHER)),
            (_producer, (dy_desc, x_desc, dy_bufs, x_bufs, ready, empty, offs_ptr, sched_ptr, M, tiles_n, tiles_k,
                         total, NUM_PROGS, TN, TK, BR, GROUP_N, COHORTS, MIX, SORTED, RAGGED, GATHER)),
            (_gatherer, (x_ptr, gather_ptr, x_bufs, ready_x, empty, offs_ptr, sched_ptr, M, K, stride_xm, tiles_n,
                         tiles_k, total, NUM_PROGS, TN, TK, BR, GROUP_N, COHORTS, MIX, SORTED)),
        ], [4, 1, GATHERER_WARPS], [GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS, GATHERER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (dw_desc, dy_bufs, x_bufs, out_bufs, ready, ready_x, empty, turn, offs_ptr, sched_ptr, M,
                         tiles_n, tiles_k, total, NUM_PROGS, 0, TN, TK, BR, GROUP_N, COHORTS, MIX, SORTED, GATHER)),
            (_consumer, (dw_desc, dy_bufs, x_bufs, out_bufs, ready, ready_x, empty, turn, offs_ptr, sched_ptr, M,
                         tiles_n, tiles_k, total, NUM_PROGS, 1, TN, TK, BR, GROUP_N, COHORTS, MIX, SORTED, GATHER)),
            (_producer, (dy_desc, x_desc, dy_bufs, x_bufs, ready, empty, offs_ptr, sched_ptr, M, tiles_n, tiles_k,
                         total, NUM_PROGS, TN, TK, BR, GROUP_N, COHORTS, MIX, SORTED, RAGGED, GATHER)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _maxnreg(gather: bool) -> int:
    # registers per thread at launch: the whole file over the kernel's warpgroups (3, or 4 with the gatherer; the
    # producer's single warp takes a warpgroup's slot); setmaxnreg shares them out again
    return 128 if gather else 168


def grouped_gemm_wgrad_pingpong(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, *, stages: int = 4,
                                group_n: int = 8, tile: tuple[int, int] = (BLOCK_N, BLOCK_K),
                                gather_rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                                num_programs: int | None = None, cohorts: int = 1, mix: bool = False,
                                sorted_groups: bool = False) -> torch.Tensor:
    """dw [G, N, K] = dy_g^T @ x_g per group (the module docstring); dy [M, N], x [M, K] bf16 contiguous on a
    Hopper GPU, N and K multiples of 8 (16-byte rows for TMA), offs [G] int32. ``tile``: each consumer's dw tile,
    (128, 128) or (64, 256) (one m64n256 wgmma per 16 rows: fewer shared-memory reads per FLOP, more L2 reads;
    slower on the H200). gather_rows [M] int32 (optional; 128x128 tiles only): row r of the grouped x
    operand is x[gather_rows[r]], with x [T, K] the token rows, copied by a fourth warpgroup (cp.async).
    ``cohorts``: groups of programs that start at different points of the tile order (_tile; 1: all together).
    ``mix``: groups heaviest first, half the programs walking backwards when the routing is skewed (_tile, MIX).
    ``sorted_groups``: groups heaviest first, every program in step (_tile, SORTED).
    Called by grouped_gemm_wgrad for the "pingpong" configs."""
    gather = gather_rows is not None
    if dy.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or dy.device.type != "cuda":
        raise ValueError("grouped_gemm_wgrad_pingpong: bf16 CUDA tensors only (a Hopper kernel)")
    rows_x = gather_rows.shape[0] if gather else x.shape[0]
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != rows_x or offs.dim() != 1:
        raise ValueError(f"grouped_gemm_wgrad_pingpong: dy {tuple(dy.shape)}, x {tuple(x.shape)}, offs "
                         f"{tuple(offs.shape)} must be [M,N], [M,K] (or [T,K] with gather_rows [M]), [G]")
    if tuple(tile) not in TILES or (gather and tuple(tile) != (128, 128)):
        raise ValueError(f"grouped_gemm_wgrad_pingpong: tile {tile} is not one of {TILES} (gathered rows: (128, 128))")
    if cohorts not in COHORT_CHOICES:
        raise ValueError(f"grouped_gemm_wgrad_pingpong: cohorts={cohorts} is not one of {COHORT_CHOICES}")
    if (cohorts != 1) + mix + sorted_groups > 1:
        raise ValueError("grouped_gemm_wgrad_pingpong: cohorts, mix and sorted_groups are schedules; choose one")
    if cuda_device.capability_major(dy.device) != 9:
        raise ValueError("grouped_gemm_wgrad_pingpong: Hopper (sm_90) only")
    dy, x = dy.contiguous(), x.contiguous()
    offs = offs.to(torch.int32).contiguous()
    M, N = dy.shape
    K, G = x.shape[1], offs.shape[0]
    if (N * 2) % 16 or (K * 2) % 16:
        raise ValueError(f"grouped_gemm_wgrad_pingpong: N={N} and K={K} must be multiples of 8 (16-byte TMA rows)")
    if gather and K % tile[1]:
        raise ValueError(f"grouped_gemm_wgrad_pingpong: gathered rows need K={K} to be a multiple of {tile[1]}")
    if M >= RAGGED_ROWS:
        raise ValueError(f"grouped_gemm_wgrad_pingpong: M={M} rows must be < 2^30 (ragged descriptors)")
    if out is None:
        out = torch.empty(G, N, K, dtype=dy.dtype, device=dy.device)
    if G == 0 or N == 0 or K == 0:
        return out
    tn, tk = tile
    dw_block = [1, tn, tk]
    dw_desc = descriptor(out, [G, N, K], [N * K, K, 1], dw_block)
    total = G * cdiv(N, tn) * cdiv(K, tk)
    nprog = max(1, min(num_programs or cuda_device.sm_count(dy.device), total))
    dy_desc = ragged_desc(dy, [BLOCK_R, tn])
    if gather:
        gather_rows = gather_rows.to(torch.int32).contiguous()
        x_desc, gather_arg = dy_desc, gather_rows  # x_desc unused
    else:
        x_desc, gather_arg = ragged_desc(x, [BLOCK_R, tk]), offs  # gather_ptr unused
    with cuda_device.on_device(dy.device):
        sched = skew_schedule(offs) if mix or sorted_groups else offs  # (unused without MIX or SORTED)
        launch(_wgrad_pingpong_kernel, (nprog,),
            dy_desc, x_desc, x, gather_arg, dw_desc, offs, sched, M, N, K, G, x.stride(0), nprog, STAGES=stages,
            GROUP_N=group_n, COHORTS=cohorts, MIX=mix, SORTED=sorted_groups, RAGGED=RAGGED_ROWS, GATHER=gather,
            num_warps=4,
            maxnreg=_maxnreg(gather))
    return out


def aot_compile(stages: int = 4, group_n: int = 8, tile: tuple[int, int] = (BLOCK_N, BLOCK_K), capability: int = 90,
                gather: bool = False, cohorts: int = 1, mix: bool = False, sorted_groups: bool = False):
    """Compile the kernel for sm_``capability`` without a GPU (the CPU tests' resource checks); returns the
    triton CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    tn, tk = tile
    dy_desc = aot_type([1, 1, BLOCK_R, tn])
    sig = {"dy_desc": dy_desc, "x_desc": dy_desc if gather else aot_type([1, 1, BLOCK_R, tk]), "x_ptr": "*bf16",
           "gather_ptr": "*i32", "dw_desc": aot_type([1, tn, tk]), "offs_ptr": "*i32", "sched_ptr": "*i32", "M": "i32",
           "N": "i32", "K": "i32", "G": "i32", "stride_xm": "i32", "NUM_PROGS": "i32", "STAGES": "constexpr",
           "GROUP_N": "constexpr", "COHORTS": "constexpr", "MIX": "constexpr", "SORTED": "constexpr",
           "RAGGED": "constexpr", "GATHER": "constexpr", "num_warps": "constexpr"}
    names = list(sig)
    aligned = ["x_ptr", "gather_ptr", "offs_ptr", "sched_ptr", "stride_xm"]
    src = GluonASTSource(_wgrad_pingpong_kernel, sig,
                         constexprs={"STAGES": stages, "GROUP_N": group_n, "COHORTS": cohorts, "MIX": mix,
                                     "SORTED": sorted_groups, "RAGGED": RAGGED_ROWS, "GATHER": gather,
                                     "num_warps": 4},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": 4, "maxnreg": _maxnreg(gather)})
