"""Grouped GEMM kernels (Triton) for the MoE expert path, and the plain PyTorch references.

Legend: M rows (routed token copies, sorted by group), G groups (experts), N = w.shape[1] (output
features of the forward), K = w.shape[2] (input features, the forward's reduction).

    x     [M, K]     bf16 / fp16 / fp32, contiguous; group g owns rows offs[g-1]..offs[g]-1
    w     [G, N, K]  same dtype, contiguous
    offs  [G]        int32 on the device, cumulative row ends (non-decreasing, offs[-1] <= M);
                     rows offs[-1]..M-1 belong to no group; groups may be empty or uneven
    y     [M, N]     forward  y_g   = x_g @ w[g]^T            (rows past offs[-1]: 0)
    dy    [M, N]     gradient of y
    dx    [M, K]     dgrad    dx_g  = dy_g @ w[g]             (rows past offs[-1]: 0)
    dw    [G, N, K]  wgrad    dw[g] = dy_g^T @ x_g            (empty groups: 0)

All three accumulate in fp32 and write the input dtype. Nothing reads offs on the host: the kernels
find their work from offs on the device, so they are sync-free and CUDA-graph capturable (after
the first call per shape, which autotunes).

Design (Hopper first; every kernel is persistent: NUM_PROGS programs loop over work tiles):
- forward / dgrad (`_rowgroup_kernel`, DGRAD constexpr): group g owns cdiv(rows_g, BLOCK_M) row
  tiles times the output column tiles, group-major, with bands of GROUP_M row tiles inside a
  group so that concurrent programs share weight and activation tiles in L2. Each program loads
  offs once, builds the cumulative tile count per group in registers (tl.cumsum) and maps a
  tile to its group with block reductions: no host sync, no extra launch. The tile loop is
  flattened (tl.range(flatten=True)) so the loads of the next tile overlap this tile's epilogue.
  TMA path: A by a 2-D descriptor (rows past the group's end only feed dropped output rows),
  w by a 3-D [G, N, K] descriptor (zero fill stays inside each expert), output by a "ragged"
  TMA store that the hardware clips at the group's end (see RAGGED below).
- wgrad (`_wgrad_kernel`): the tiles are the BLOCK_M x BLOCK_N tiles of every dw[g]; the
  reduction runs over the group's rows (variable K), so the (tile, row chunk) loop is flattened
  by hand into one pipelined loop. Tiles run in bands of GROUP_N dw row tiles (config group_m),
  column-major inside a band (1: row-major); on DeepSeek-V3's layouts, big experts included, bands
  of 1-16 timed within noise of each other (bench/NOTES.md, session 5).
  Configs with tma_store=False keep the TMA loads but store dw from registers: at DeepSeek-V3 dw is 15 GB,
  about as much time in stores as in MMA, and a register store needs no shared-memory buffer (a stage
  more) and no wait before the next tile's main loop. TMA path: dy and x by ragged descriptors (rows past the
  group's end read as zeros), dw by a 3-D TMA store.
- forward / wgrad with gather_rows: the rows of x are read through an index array (x_perm never
  exists) by pointer loads (Hopper TMA has no row gather); the other operands still use TMA.
- TAIL SPLIT (configs with tail_split): a group's last partial tile wastes MMA work on rows past
  its end, up to BLOCK_M - 1 rows per group; with uneven routing over many experts that is ~29%
  of the forward's work at DeepSeek-V3 shapes with 128-row tiles (Dirichlet(0.3) shares). So a
  first launch (PART=1) covers whole tiles and remainders of more than half a tile, and a second
  launch with half-height tiles (PART=2) covers the remainders of at most half a tile: the waste
  halves, full tiles keep their efficiency, and balanced routing pays one launch with no work.
- USE_TMA=False: masked pointer loads and stores everywhere. Both paths run under
  TRITON_INTERPRET=1 (fp32 only: the 3.6 interpreter computes bf16 dots wrongly).
- Autotuning (`grouped_gemm_tuning.pick_config`): the first call per (op, dtype, N, K, M/G bucket) times every
  candidate config, in turns over a few rounds (median of CUDA-event timings), and keeps the fastest.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from moetrain.kernels import cuda_device
from moetrain.kernels.host import cdiv, next_pow2, rows_bucket
from moetrain.kernels.schedule import skew_schedule

from moetrain.kernels.grouped_gemm_tuning import (  # noqa: F401  (GemmConfig, configs_for: public API)
    INTERPRETER_PROGRAMS, PINGPONG_WGRAD_CONFIGS, ROWGROUP_CONFIGS, WGRAD_CONFIGS, GemmConfig, configs_for,
    interpreter_numpy_shim,
    interpreting, pick_config, tail_config)

# ----------------------------------------------------------------------------------------------
# References (obviously correct; they read offs on the host).
# ----------------------------------------------------------------------------------------------


def _ranges(offs: torch.Tensor, m: int):
    start = 0
    for end in offs.tolist():
        end = min(max(end, start), m)
        yield start, end
        start = end


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x_g @ w[g]^T per group, zeros past offs[-1]; computed in x's dtype."""
    y = x.new_zeros(x.shape[0], w.shape[1])
    for g, (s, e) in enumerate(_ranges(offs, x.shape[0])):
        y[s:e] = x[s:e] @ w[g].t()
    return y


def grouped_gemm_dgrad_ref(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dx [M, K] = dy_g @ w[g] per group, zeros past offs[-1]."""
    dx = dy.new_zeros(dy.shape[0], w.shape[2])
    for g, (s, e) in enumerate(_ranges(offs, dy.shape[0])):
        dx[s:e] = dy[s:e] @ w[g]
    return dx


def grouped_gemm_wgrad_ref(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dw [G, N, K] = dy_g^T @ x_g per group, zeros for empty groups."""
    dw = dy.new_zeros(offs.shape[0], dy.shape[1], x.shape[1])
    for g, (s, e) in enumerate(_ranges(offs, dy.shape[0])):
        dw[g] = dy[s:e].t() @ x[s:e]
    return dw


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


# "Ragged" TMA addressing: a 2-D tensor T [R, C] with row stride rs is described as 4-D with
# shape [2^31-ish, 2^31-ish, 2^30, C] and strides [2^34 - rs, rs, rs, 1]. Coordinates
# [2^30, end, 2^30 - end + row, col] address T[row, col] (the first two terms cancel modulo 2^64),
# and the hardware bounds check on the third dimension (< 2^30) becomes row < end: loads past a
# group's end read zeros and stores past it are dropped, with no masks in the kernel.
RAGGED_ROWS = 1 << 30
RAGGED = tl.constexpr(RAGGED_ROWS)  # the same, visible inside kernels


# Row-group scheduling of the forward / dgrad kernel, as jit helpers.
@triton.jit
def _row_tiles(offs_ptr, sched_ptr, M, OUT, G, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_G: tl.constexpr, PART: tl.constexpr, BIG_M: tl.constexpr, MIX: tl.constexpr):
    """Per slot of the group order (the groups themselves; MIX: sched_ptr's order, see schedule.py) [BLOCK_G]: the
    group's row end (ends) and start (starts), the group (groups), the cumulative tile count (tile_ends); the tile
    total and the column tiles per row tile, for this launch's segment of each group (PART, see TAIL SPLIT)."""
    # Row range of every group, in registers. Slots past G repeat the last end (empty groups).
    gi = tl.arange(0, BLOCK_G)
    if MIX:
        groups = tl.load(sched_ptr + tl.minimum(gi, G - 1))
        ends = tl.load(offs_ptr + groups)
        ends = tl.minimum(tl.maximum(ends, 0), M)
        starts = tl.load(offs_ptr + tl.maximum(groups - 1, 0), mask=groups > 0, other=0)
        starts = tl.where(gi < G, tl.minimum(tl.maximum(starts, 0), M), ends)  # slots past G: empty
    else:  # (in this order: the pointer-load configs sit at 255 registers, and ptxas spilled when it changed)
        groups = gi
        ends = tl.load(offs_ptr + tl.minimum(gi, G - 1))
        ends = tl.minimum(tl.maximum(ends, 0), M)
        starts = tl.load(offs_ptr + tl.maximum(tl.minimum(gi - 1, G - 1), 0), mask=gi > 0, other=0)
        starts = tl.minimum(tl.maximum(starts, 0), M)
    rows = tl.maximum(ends - starts, 0)
    # This launch's segment [seg_s, seg_e) of every group.
    if PART == 0:
        seg_s = starts
        seg_e = starts + rows
    elif PART == 1:  # whole tiles, and a remainder of more than half a tile
        whole_rows = rows // BLOCK_M * BLOCK_M
        seg_s = starts
        seg_e = starts + whole_rows + tl.where(rows - whole_rows > BLOCK_M // 2, rows - whole_rows, 0)
    else:  # the remainder the body left: at most half of its tile
        whole_rows = rows // BIG_M * BIG_M
        seg_s = starts + whole_rows
        seg_e = tl.where(rows - whole_rows <= BIG_M // 2, ends, seg_s)
    row_tiles = (tl.maximum(seg_e - seg_s, 0) + BLOCK_M - 1) // BLOCK_M
    n_tiles = (OUT + BLOCK_N - 1) // BLOCK_N
    tile_ends = tl.cumsum(row_tiles, 0) * n_tiles  # slot s owns tiles [tile_ends[s-1], tile_ends[s])
    total = tl.max(tile_ends, 0)
    return ends, starts, groups, tile_ends, total, n_tiles


@triton.jit
def _tile_at(tile, ends, starts, groups, tile_ends, M, n_tiles, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, PART: tl.constexpr, BIG_M: tl.constexpr,
             MIX: tl.constexpr):
    """(group g, first row m0, first column n0, the group's row end) of work tile ``tile``."""
    # The tile's slot: the number of slots whose tiles all come before it.
    before = tile_ends <= tile
    slot = tl.sum(before.to(tl.int32), 0)
    tile0 = tl.max(tl.where(before, tile_ends, 0), 0)
    if MIX:  # slots in sched order: the group and its rows picked out of the slot vectors
        here = tl.arange(0, ends.shape[0]) == slot
        g = tl.sum(tl.where(here, groups, 0), 0)
        row0 = tl.sum(tl.where(here, starts, 0), 0)
        row_end = tl.sum(tl.where(here, ends, 0), 0)
    else:  # slots are the groups in order: the group starts where the previous one ends
        g = slot
        row0 = tl.max(tl.where(before, ends, 0), 0)
        row_end = tl.min(tl.where(before, M, ends), 0)
    # This launch's segment of the group, as in _row_tiles but in scalars (no more vectors live in the loop)
    if PART == 1:
        whole = (row_end - row0) // BLOCK_M * BLOCK_M
        left = row_end - row0 - whole
        row_end = row0 + whole + tl.where(left > BLOCK_M // 2, left, 0)
    elif PART == 2:
        row0 = row0 + (row_end - row0) // BIG_M * BIG_M
    # Grouped ordering inside the group: bands of GROUP_M row tiles, column tiles outer.
    local = tile - tile0
    m_tiles_g = (row_end - row0 + BLOCK_M - 1) // BLOCK_M
    band = local // (GROUP_M * n_tiles)
    first_m = band * GROUP_M
    band_m = tl.minimum(m_tiles_g - first_m, GROUP_M)
    r = local - band * (GROUP_M * n_tiles)
    m0 = row0 + (first_m + r % band_m) * BLOCK_M
    n0 = (r // band_m) * BLOCK_N
    return g, m0, n0, row_end


@triton.jit
def _a_rows(a_ptr, gather_ptr, m0, rm, row_ok, stride_am, GATHER: tl.constexpr):
    """[BLOCK_M, 1] pointers to the tile's A rows: rows m0.. of A, or (GATHER) the token rows gather[m0..] (no
    permuted copy: pointer loads, since Hopper's TMA cannot gather rows)."""
    if GATHER:
        src = tl.load(gather_ptr + m0 + rm, mask=row_ok, other=0)
        return a_ptr + src.to(tl.int64)[:, None] * stride_am
    return a_ptr + m0.to(tl.int64) * stride_am + rm[:, None] * stride_am


@triton.jit
def _zero_rows_past_groups(out_ptr, ends, M, OUT, stride_om, pid, NUM_PROGS, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, PART: tl.constexpr):
    """Rows past the last group's end belong to no group: write zeros to out [M, OUT] there (usually none)."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    n_tiles = (OUT + BLOCK_N - 1) // BLOCK_N
    tail0 = tl.max(ends, 0)
    tail_tiles = ((M - tail0 + BLOCK_M - 1) // BLOCK_M) * n_tiles if PART != 2 else 0
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    for t in range(pid, tail_tiles, NUM_PROGS):
        m0 = tail0 + (t // n_tiles) * BLOCK_M
        n0 = (t % n_tiles) * BLOCK_N
        o_ptrs = out_ptr + m0.to(tl.int64) * stride_om + rm[:, None] * stride_om + (n0 + rn)[None, :]
        tl.store(o_ptrs, zeros, mask=((m0 + rm) < M)[:, None] & ((n0 + rn) < OUT)[None, :])


# Row counts, group counts and the grid size change with routing and shape but not the code:
# leave them unspecialized so that they do not multiply compilations.
@triton.jit(do_not_specialize=["M", "G", "NUM_PROGS"])
def _rowgroup_kernel(
    a_ptr, a_desc,  # A [M, RED]: x (forward) or dy (dgrad); a_desc 2-D, block [BLOCK_M, BLOCK_K]
    gather_ptr,  # GATHER: [M] int32 source row of each A row (A is then [T, RED], rows gathered)
    w_ptr, w_desc,  # w [G, D1, D2]; w_desc 3-D, block [1, BLOCK_N, BLOCK_K] (forward) / [1, BLOCK_K, BLOCK_N]
    out_ptr, out_desc,  # out [M, OUT]; out_desc ragged 4-D, block [1, 1, BLOCK_M, BLOCK_N]
    offs_ptr,  # [G] int32
    sched_ptr,  # MIX: [G + 1] int32, schedule.skew_schedule(offs) (else unused)
    M, OUT, RED, G,
    stride_am, stride_wg, stride_w1, stride_om,
    NUM_PROGS,
    DGRAD: tl.constexpr,  # False: OUT = D1, RED = D2 (y = x w^T); True: RED = D1, OUT = D2 (dx = dy w)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr, USE_TMA: tl.constexpr, FLATTEN: tl.constexpr, PRECISION: tl.constexpr,
    GATHER: tl.constexpr,
    PART: tl.constexpr,  # 0: every row; 1: body (see TAIL SPLIT); 2: tail, with BIG_M the body's BLOCK_M
    BIG_M: tl.constexpr,
    MIX: tl.constexpr,  # groups in sched_ptr's order; on skewed routing half the programs walk backwards
):
    pid = tl.program_id(0)
    out_dtype = out_ptr.dtype.element_ty
    ends, starts, groups, tile_ends, total, n_tiles = _row_tiles(offs_ptr, sched_ptr, M, OUT, G, BLOCK_M, BLOCK_N,
                                                                 BLOCK_G, PART, BIG_M, MIX)
    k_tiles = (RED + BLOCK_K - 1) // BLOCK_K
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    backwards = False
    count = 0
    if MIX:  # this program's tiles in reverse (light groups first) where the routing is skewed: schedule.py
        backwards = (pid * 2 >= NUM_PROGS) & (tl.load(sched_ptr + G) != 0)
        count = (total - pid + NUM_PROGS - 1) // NUM_PROGS

    for step_tile in tl.range(pid, total, NUM_PROGS, flatten=FLATTEN):
        tile = step_tile
        if MIX:
            tile = tl.where(backwards, pid + (count - 1 - (step_tile - pid) // NUM_PROGS) * NUM_PROGS, step_tile)
        g, m0, n0, row_end = _tile_at(tile, ends, starts, groups, tile_ends, M, n_tiles, BLOCK_M, BLOCK_N, GROUP_M,
                                      PART, BIG_M, MIX)
        w_base = w_ptr + g.to(tl.int64) * stride_wg
        row_ok = (m0 + rm) < row_end
        a_rows = _a_rows(a_ptr, gather_ptr, m0, rm, row_ok, stride_am, GATHER)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            k_ok = (k0 + rk) < RED
            if USE_TMA and not GATHER:
                # Rows past the group's end belong to the next group: they only feed output rows
                # that the ragged store drops. TMA zero-fills past M, RED and w's extents.
                a = a_desc.load([m0, k0])
            else:
                a = tl.load(a_rows + (k0 + rk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if USE_TMA:
                if DGRAD:
                    b = w_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
                else:
                    b = w_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
            else:
                n_ok = (n0 + rn) < OUT
                if DGRAD:
                    b = tl.load(w_base + (k0 + rk)[:, None] * stride_w1 + (n0 + rn)[None, :],
                                mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                else:
                    b = tl.load(w_base + (n0 + rn)[None, :] * stride_w1 + (k0 + rk)[:, None],
                                mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)

        c = acc.to(out_dtype)
        if USE_TMA:
            out_desc.store([RAGGED, row_end, RAGGED - row_end + m0, n0], c.reshape(1, 1, BLOCK_M, BLOCK_N))
        else:
            o_ptrs = out_ptr + m0.to(tl.int64) * stride_om + rm[:, None] * stride_om + (n0 + rn)[None, :]
            tl.store(o_ptrs, c, mask=row_ok[:, None] & ((n0 + rn) < OUT)[None, :])

    _zero_rows_past_groups(out_ptr, ends, M, OUT, stride_om, pid, NUM_PROGS, BLOCK_M, BLOCK_N, PART)


@triton.jit(do_not_specialize=["M", "G", "NUM_PROGS"])
def _wgrad_kernel(
    dy_ptr, dy_desc,  # dy [M, N]; dy_desc ragged 4-D, block [1, 1, BLOCK_K, BLOCK_M]
    x_ptr, x_desc,  # x [M, K]; x_desc ragged 4-D, block [1, 1, BLOCK_K, BLOCK_N] (GATHER: x is [T, K])
    gather_ptr,  # GATHER: [M] int32, source row in x of each grouped row
    dw_ptr, dw_desc,  # dw [G, N, K]; dw_desc 3-D, block [1, BLOCK_M, BLOCK_N]
    offs_ptr,  # [G] int32
    M, N, K, G,
    stride_dym, stride_xm, stride_dwg, stride_dwn,
    NUM_PROGS,
    BLOCK_M: tl.constexpr,  # dw tile rows (over N)
    BLOCK_N: tl.constexpr,  # dw tile columns (over K)
    BLOCK_K: tl.constexpr,  # reduction step (over the group's rows)
    GROUP_N: tl.constexpr,  # dw row tiles per L2 band (1: row-major tiles, each band one dw row of tiles)
    BLOCK_G: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr, GATHER: tl.constexpr,
    TMA_STORE: tl.constexpr,  # with USE_TMA: store dw by TMA (else from registers: no smem buffer, no store wait)
):
    pid = tl.program_id(0)
    out_dtype = dw_ptr.dtype.element_ty
    tiles_k = (K + BLOCK_N - 1) // BLOCK_N
    tiles_n = (N + BLOCK_M - 1) // BLOCK_M
    per_group = tiles_n * tiles_k
    band = GROUP_N * tiles_k

    # This program's iteration count: per group, (its tiles that are ours) x (row chunks, at
    # least 1 so that an empty group still stores its zero tile). Tiles are group-major.
    gi = tl.arange(0, BLOCK_G)
    ends = tl.load(offs_ptr + gi, mask=gi < G, other=0)
    starts = tl.load(offs_ptr + gi - 1, mask=(gi > 0) & (gi < G), other=0)
    rows = tl.maximum(tl.minimum(ends, M) - tl.minimum(tl.maximum(starts, 0), M), 0)
    chunks = tl.maximum((rows + BLOCK_K - 1) // BLOCK_K, 1)
    lo = gi * per_group
    mine = (lo + per_group - pid + NUM_PROGS - 1) // NUM_PROGS - (lo - pid + NUM_PROGS - 1) // NUM_PROGS
    iters = tl.sum(tl.where(gi < G, mine * chunks, 0), 0)

    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # State of the hand-flattened (tile, row chunk) loop: one scf.for that the pipeliner can
    # overlap across tiles (tl.range(flatten=True) needs a loop-invariant inner trip count).
    tile = pid
    ki = pid * 0
    nk = ki + 1
    g = ki
    row0 = ki
    row_end = ki
    n0 = ki
    k0 = ki
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, iters):
        if ki == 0:
            g = tile // per_group
            local = tile - g * per_group
            # Bands of GROUP_N dw row tiles, column-major inside a band: the programs working at once
            # on one group read GROUP_N column blocks of dy and ~P / GROUP_N of x's (GROUP_N = 1: all of x_g)
            first_n = (local // band) * GROUP_N
            band_rows = tl.minimum(tiles_n - first_n, GROUP_N)
            in_band = local - (local // band) * band
            n0 = (first_n + in_band % band_rows) * BLOCK_M
            k0 = (in_band // band_rows) * BLOCK_N
            row0 = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
            row_end = tl.load(offs_ptr + g)
            row0 = tl.minimum(tl.maximum(row0, 0), M)
            row_end = tl.maximum(tl.minimum(row_end, M), row0)
            nk = tl.maximum((row_end - row0 + BLOCK_K - 1) // BLOCK_K, 1)
        r0 = row0 + ki * BLOCK_K
        r_ok = (r0 + rk) < row_end
        if USE_TMA:
            # Ragged loads: rows at or past the group's end read as zeros.
            a = dy_desc.load([RAGGED, row_end, RAGGED - row_end + r0, n0]).reshape(BLOCK_K, BLOCK_M)
        else:
            a = tl.load(dy_ptr + r0.to(tl.int64) * stride_dym + rk[:, None] * stride_dym + (n0 + rm)[None, :],
                        mask=r_ok[:, None] & ((n0 + rm) < N)[None, :], other=0.0)
        if GATHER:
            # x rows straight from the token rows (no permuted copy): pointer loads (no TMA row gather)
            src = tl.load(gather_ptr + r0 + rk, mask=r_ok, other=0)
            b = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xm + (k0 + rn)[None, :],
                        mask=r_ok[:, None] & ((k0 + rn) < K)[None, :], other=0.0)
        elif USE_TMA:
            b = x_desc.load([RAGGED, row_end, RAGGED - row_end + r0, k0]).reshape(BLOCK_K, BLOCK_N)
        else:
            b = tl.load(x_ptr + r0.to(tl.int64) * stride_xm + rk[:, None] * stride_xm + (k0 + rn)[None, :],
                        mask=r_ok[:, None] & ((k0 + rn) < K)[None, :], other=0.0)
        acc = tl.dot(a.T, b, acc, input_precision=PRECISION)
        # Only the store sits under the branch; the bookkeeping is selects, so the pipeliner can
        # compute the next iterations' load coordinates ahead (the shape tl.range(flatten=True) makes).
        last = ki == nk - 1
        if last:
            c = acc.to(out_dtype)
            if USE_TMA and TMA_STORE:
                dw_desc.store([g, n0, k0], c.reshape(1, BLOCK_M, BLOCK_N))
            else:
                o_ptrs = (dw_ptr + g.to(tl.int64) * stride_dwg + n0.to(tl.int64) * stride_dwn
                          + rm[:, None] * stride_dwn + (k0 + rn)[None, :])
                tl.store(o_ptrs, c, mask=((n0 + rm) < N)[:, None] & ((k0 + rn) < K)[None, :])
            # A zero yielded from the branch becomes the MMA's use-accumulator flag (no select).
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        tile = tl.where(last, tile + NUM_PROGS, tile)
        ki = tl.where(last, 0, ki + 1)


def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return cuda_device.sm_count(device)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need Hopper+, a 16-byte aligned base and 16-byte aligned leading strides."""
    t0 = tensors[0]
    if t0.device.type == "cuda":
        if cuda_device.capability_major(t0.device) < 9:
            return False
    elif not interpreting():
        return False
    for t in tensors:
        if t.data_ptr() % 16 or t.stride(-1) != 1:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _ragged_desc(t: torch.Tensor, block: list):
    """4-D "ragged" descriptor of a 2-D tensor (see RAGGED above); rows must be < 2^30."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    rs = t.stride(0)
    return TensorDescriptor(t, [0x7FFF0000, 0x7FFF0000, RAGGED_ROWS, t.shape[1]], [(1 << 34) - rs, rs, rs, 1], [1, 1, *block])


def _precision(dtype: torch.dtype) -> str:
    # fp32 follows torch's matmul precision setting (tf32 unless "highest"); 16-bit ignores it.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"grouped GEMM: tensors on different devices {[str(t.device) for t in tensors]}")
    if dev.type == "cuda":
        return
    if not interpreting():
        raise RuntimeError(f"Triton grouped GEMM needs CUDA tensors (got {dev}) or TRITON_INTERPRET=1 "
                           "set before triton is imported (CPU interpreter)")
    interpreter_numpy_shim()


def _on_device(device: torch.device):
    # Triton launches on the current CUDA device: make it the tensors' one.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _block_g(groups: int) -> int:
    # One compiled kernel serves every expert count up to 256 (the group vectors are tiny).
    return max(256, next_pow2(groups))


def _row_programs(device: torch.device, cfg: GemmConfig, M: int, G: int, OUT: int, block_n: int, part: int,
                  num_programs: int | None) -> int:
    """Persistent grid of a row-group launch (``cfg`` the launched config): programs_per_sm per SM, or num_programs,
    at most the tile count's bound without reading offs (every group adds at most one partial row tile; a tail
    launch, PART 2, has at most one tile row per group)."""
    bound = (cdiv(M, cfg.block_m) + G) * cdiv(OUT, block_n) if part != 2 else G * cdiv(OUT, block_n)
    return max(1, min(num_programs or _num_programs(device) * cfg.programs_per_sm, bound))


def _run_tail_split(cfg: GemmConfig, launch, tail=tail_config) -> None:
    """``launch(config, part, big_m)`` once (PART 0), or for a tail-split config the body (PART 1) and then the
    half-height tail (PART 2, ``tail(cfg)``): see TAIL SPLIT."""
    if not cfg.tail_split:
        launch(cfg, 0, cfg.block_m)
        return
    launch(cfg, 1, cfg.block_m)
    launch(tail(cfg), 2, cfg.block_m)


def _output(out, shape, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {like.dtype} tensor of shape {tuple(shape)}")
    return out


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def grouped_gemm_fwd(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, gather_rows: torch.Tensor | None = None,
                     config: GemmConfig | None = None, out: torch.Tensor | None = None,
                     num_programs: int | None = None) -> torch.Tensor:
    """Forward: y [M, N] = x_g @ w[g]^T per group; rows past offs[-1] are 0.

    x [M, K], w [G, N, K] (same dtype: bf16/fp16/fp32), offs [G] int32 cumulative row ends on
    x's device. Returns y [M, N] in x's dtype (fp32 accumulation).
    gather_rows [M] int32/int64 (optional): row r of the grouped operand is x[gather_rows[r]],
    with x [T, K] the unpermuted token rows (the permuted copy is never materialized).
    ``config`` bypasses the autotuner; ``out`` (contiguous [M, N]) receives the result;
    ``num_programs`` overrides the persistent grid size (default: programs_per_sm per SM).
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or offs.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm_fwd: x {tuple(x.shape)}, w {tuple(w.shape)}, offs {tuple(offs.shape)} "
                         "must be [M,K], [G,N,K], [G]")
    if gather_rows is not None and gather_rows.dim() != 1:
        raise ValueError(f"grouped_gemm_fwd: gather_rows {tuple(gather_rows.shape)} must be [M]")
    return _rowgroup(x, w, offs, False, config, out, num_programs, gather_rows)


def grouped_gemm_dgrad(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, config: GemmConfig | None = None,
                       out: torch.Tensor | None = None, num_programs: int | None = None) -> torch.Tensor:
    """Data gradient: dx [M, K] = dy_g @ w[g] per group; rows past offs[-1] are 0.

    dy [M, N], w [G, N, K] (same dtype), offs [G] int32. Returns dx [M, K] in dy's dtype.
    Same kernel as the forward, with w read as [N, K] (no transposed copy of w).
    """
    if dy.dim() != 2 or w.dim() != 3 or dy.shape[1] != w.shape[1] or offs.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm_dgrad: dy {tuple(dy.shape)}, w {tuple(w.shape)}, offs {tuple(offs.shape)} "
                         "must be [M,N], [G,N,K], [G]")
    return _rowgroup(dy, w, offs, True, config, out, num_programs)


def _rowgroup(a, w, offs, dgrad, config, out, num_programs, gather=None):
    _check_device(a, w, offs)
    if a.dtype != w.dtype:
        raise ValueError(f"grouped GEMM: dtypes differ ({a.dtype}, {w.dtype})")
    a, w = a.contiguous(), w.contiguous()
    offs = offs.to(torch.int32).contiguous()
    M, RED = a.shape
    if gather is not None:
        _check_device(a, gather)
        gather = gather.to(torch.int32).contiguous()
        M = gather.shape[0]
    G, D1, D2 = w.shape
    OUT = D2 if dgrad else D1
    out = _output(out, (M, OUT), a)
    if M == 0 or OUT == 0:
        return out
    if G == 0 or RED == 0:
        return out.zero_()
    tma_ok = _tma_ok(a, w, out) and M < RAGGED_ROWS

    def launch(cfg: GemmConfig, part: int, big_m: int, sched: torch.Tensor):
        use_tma = cfg.use_tma and tma_ok
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor
            a_desc = a if gather is not None else TensorDescriptor(a, [M, RED], [RED, 1], [bm, bk])
            w_desc = TensorDescriptor(w, [G, D1, D2], [D1 * D2, D2, 1], [1, bk, bn] if dgrad else [1, bn, bk])
            out_desc = _ragged_desc(out, [bm, bn])
        else:
            a_desc, w_desc, out_desc = a, w, out
        nprog = _row_programs(a.device, cfg, M, G, OUT, bn, part, num_programs)
        _rowgroup_kernel[(nprog,)](
            a, a_desc, offs if gather is None else gather, w, w_desc, out, out_desc, offs, sched, M, OUT, RED, G,
            a.stride(0), w.stride(0), w.stride(1), out.stride(0), nprog,
            DGRAD=dgrad, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
            BLOCK_G=_block_g(G), USE_TMA=use_tma,
            FLATTEN=not interpreting(), PRECISION=_precision(a.dtype), GATHER=gather is not None,
            PART=part, BIG_M=big_m, MIX=cfg.mix, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def run(cfg: GemmConfig):
        sched = skew_schedule(offs) if cfg.mix else offs  # (unused without MIX)
        _run_tail_split(cfg, lambda c, part, big_m: launch(c, part, big_m, sched))

    op = "dgrad" if dgrad else ("fwd_gather" if gather is not None else "fwd")
    key = (op, a.dtype, a.device, OUT, RED, rows_bucket(M, G), tma_ok)
    with _on_device(a.device):
        run(pick_config(key, ROWGROUP_CONFIGS, config, run))
    return out


def grouped_gemm_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, *, gather_rows: torch.Tensor | None = None,
                       config: GemmConfig | None = None, out: torch.Tensor | None = None,
                       num_programs: int | None = None) -> torch.Tensor:
    """Weight gradient (variable-K grouped GEMM): dw [G, N, K] = dy_g^T @ x_g per group.

    dy [M, N], x [M, K] (same dtype), offs [G] int32. Returns dw [G, N, K] in dy's dtype; groups
    with no rows get zeros; rows past offs[-1] do not contribute. On the TMA path, rows of other
    groups that share a row chunk are multiplied by exact zeros, so they must be finite.
    gather_rows [M] int32/int64 (optional): row r of the grouped x operand is x[gather_rows[r]], with
    x [T, K] the unpermuted token rows (the permuted copy is never materialized; x by pointer loads).
    """
    rows_x = x.shape[0] if gather_rows is None else gather_rows.shape[0]
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != rows_x or offs.dim() != 1:
        raise ValueError(f"grouped_gemm_wgrad: dy {tuple(dy.shape)}, x {tuple(x.shape)}, offs {tuple(offs.shape)} "
                         "must be [M,N], [M,K], [G]")
    _check_device(dy, x, offs)
    if dy.dtype != x.dtype:
        raise ValueError(f"grouped GEMM: dtypes differ ({dy.dtype}, {x.dtype})")
    dy, x = dy.contiguous(), x.contiguous()
    offs = offs.to(torch.int32).contiguous()
    if gather_rows is not None:
        _check_device(dy, gather_rows)
        gather_rows = gather_rows.to(torch.int32).contiguous()
    M, N = dy.shape
    K = x.shape[1]
    G = offs.shape[0]
    out = _output(out, (G, N, K), dy)
    if G == 0 or N == 0 or K == 0:
        return out
    if M == 0:
        return out.zero_()
    tma_ok = _tma_ok(dy, x, out) and M < RAGGED_ROWS
    pingpong_ok = tma_ok and pingpong_applies(dy) and (gather_rows is None or K % 128 == 0)
    if config is not None and config.kernel == "pingpong" and not pingpong_ok:
        raise ValueError(f"grouped_gemm_wgrad: config {config} needs a Hopper GPU, bf16 and TMA-aligned tensors "
                         "(with gathered rows, K a multiple of 128)")

    def run(cfg: GemmConfig):
        if cfg.kernel == "pingpong":
            from moetrain.kernels.wgrad_pingpong import grouped_gemm_wgrad_pingpong

            grouped_gemm_wgrad_pingpong(dy, x, offs, stages=cfg.num_stages, group_n=cfg.group_m,
                                        tile=(cfg.block_m, cfg.block_n), gather_rows=gather_rows, out=out,
                                        num_programs=num_programs, cohorts=cfg.cohorts, mix=cfg.mix)
            return
        use_tma = cfg.use_tma and tma_ok
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor
            dy_desc = _ragged_desc(dy, [bk, bm])
            x_desc = _ragged_desc(x, [bk, bn]) if gather_rows is None else x
            dw_desc = TensorDescriptor(out, [G, N, K], [N * K, K, 1], [1, bm, bn])
        else:
            dy_desc, x_desc, dw_desc = dy, x, out
        nprog = max(1, min(num_programs or _num_programs(dy.device) * cfg.programs_per_sm,
                           G * cdiv(N, bm) * cdiv(K, bn)))
        _wgrad_kernel[(nprog,)](
            dy, dy_desc, x, x_desc, gather_rows if gather_rows is not None else offs, out, dw_desc, offs, M, N, K, G,
            dy.stride(0), x.stride(0), out.stride(0), out.stride(1), nprog,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=cfg.group_m, BLOCK_G=_block_g(G),
            USE_TMA=use_tma, PRECISION=_precision(dy.dtype), GATHER=gather_rows is not None, TMA_STORE=cfg.tma_store,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    key = ("wgrad" if gather_rows is None else "wgrad_gather", dy.dtype, dy.device, N, K, rows_bucket(M, G), tma_ok)
    with _on_device(dy.device):
        # (the gathered ping-pong configs are on trial: explicit configs only)
        pingpong = PINGPONG_WGRAD_CONFIGS if pingpong_ok and gather_rows is None else ()
        run(pick_config(key, WGRAD_CONFIGS + pingpong, config, run))
    return out


def pingpong_applies(dy: torch.Tensor) -> bool:
    """Whether the ping-pong weight gradient (wgrad_pingpong.py) can run on dy's device and dtype: compiled kernels
    (not the interpreter) on a Hopper GPU, bf16, and a triton with Gluon. The caller checks TMA alignment."""
    if interpreting() or dy.device.type != "cuda" or dy.dtype != torch.bfloat16:
        return False
    return cuda_device.capability_major(dy.device) == 9 and _gluon_available()


@functools.cache  # asked on every weight-gradient call (the layer's host path)
def _gluon_available() -> bool:
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True
