"""The grouped GEMM's Triton kernels: the forward / data gradient (`_rowgroup_kernel`) and the weight gradient
(`_wgrad_kernel`), with their jit helpers. Shapes, dtypes and the design: grouped_gemm.py's docstring, whose
launchers (grouped_gemm_fwd / _dgrad / _wgrad) are the way to call them; the references are there too.
"""

from __future__ import annotations

import triton
import triton.language as tl

# "Ragged" TMA addressing: a 2-D tensor T [R, C] with row stride rs is described as 4-D with
# shape [2^31-ish, 2^31-ish, 2^30, C] and strides [2^34 - rs, rs, rs, 1]. Coordinates
# [2^30, end, 2^30 - end + row, col] address T[row, col] (the first two terms cancel modulo 2^64),
# and the hardware bounds check on the third dimension (< 2^30) becomes row < end: loads past a
# group's end read zeros and stores past it are dropped, with no masks in the kernel.
RAGGED_ROWS = 1 << 30
RAGGED = tl.constexpr(RAGGED_ROWS)  # the same, visible inside kernels


def ragged_geometry(columns: int, row_stride: int) -> tuple[list, list]:
    """(shape, strides) of the ragged 4-D view of a [R, columns] tensor with this row stride (above); the Triton and
    the Gluon descriptors (grouped_gemm.py, gluon_descs.py) both take it."""
    rs = row_stride
    return [0x7FFF0000, 0x7FFF0000, RAGGED_ROWS, columns], [(1 << 34) - rs, rs, rs, 1]


def block_g(groups: int) -> int:
    """BLOCK_G, the group vectors' length inside the kernels: one compiled kernel serves every expert count up to 256
    (the group vectors are tiny), then one per power of 2."""
    return max(256, 1 << max(0, groups - 1).bit_length())


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
    skewed = False
    count = 0
    if MIX:  # where the routing is skewed (schedule.py): half the programs walk their tiles in reverse (light groups
        # first), and odd full rounds are dealt from the last program down (each program gets as much work)
        skewed = tl.load(sched_ptr + G) != 0
        count = (total - pid + NUM_PROGS - 1) // NUM_PROGS

    for step_tile in tl.range(pid, total, NUM_PROGS, flatten=FLATTEN):
        tile = step_tile
        if MIX:
            j = (step_tile - pid) // NUM_PROGS
            j = tl.where(skewed & (pid * 2 >= NUM_PROGS), count - 1 - j, j)
            q = tl.where(skewed & (j % 2 == 1) & (j < total // NUM_PROGS), NUM_PROGS - 1 - pid, pid)
            tile = j * NUM_PROGS + q
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
