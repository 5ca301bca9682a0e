"""FC1 with SwiGLU in its epilogue (Triton): the expert path's first GEMM writes both the pre-activation h that
SwiGLU's backward needs and the activation a that FC2 reads, so the separate SwiGLU forward kernel (which reads
h again: 1.9 GB at Mixtral, 0.69 ms of its layer) goes away.

Legend: M routed rows (sorted by expert), G experts, H hidden (the reduction), I expert intermediate.

    x      [M, H]      bf16 / fp16 / fp32 (or [T, H] read through gather_rows [M], as grouped_gemm_fwd)
    w1     [G, 2I, H]  same dtype; rows 0..I-1 of w1[g] the gate, I..2I-1 the up projection
    offs   [G]         int32 cumulative row ends (grouped_gemm.py's convention)
    probs  [M]         fp32 or None: a per-row factor on a (the routing weights applied before FC2)
    h      [M, 2I]     = x_g @ w1[g]^T                              (rows past offs[-1]: 0)
    a      [M, I]      = act(h[:, :I], h[:, I:]) * probs[:, None]   (computed from h as stored, like the
                                                                    separate kernel: the same numbers)

A work tile is BLOCK_M rows x BLOCK_N intermediate columns j: the kernel loads the gate rows j and the up rows
I + j of w1[g], the same MMA work and registers as one [BLOCK_M, 2 BLOCK_N] tile of the plain forward, so a
config of the plain forward with block_n = 2 BLOCK_N runs here with the same shared memory per stage. PAIRED
(default): one B tile through a 4-D [G, 2, I, H] descriptor (gate and up planes in one box) and one accumulator,
split into gate and up in the epilogue; else two descriptors and two accumulators (two MMAs of half the width,
which read the A tile from shared memory twice). Scheduling (groups, tail split, L2 bands) is the
plain forward's (grouped_gemm._row_tiles / _tile_at). h is stored by TMA through ragged descriptors of its two
halves (TMA_H, default; the plain forward's store) or from registers; a from registers (a third TMA store buffer
would not fit beside three stages).
The reference is grouped_gemm_ref followed by moetrain.ops.moe_rows.swiglu_torch (``fc1_swiglu_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.grouped_gemm import (
    RAGGED, RAGGED_ROWS, _a_rows, _block_g, _check_device, _on_device, _output, _precision, _ragged_desc, _row_programs,
    _row_tiles, _run_tail_split, _tile_at, _tma_ok, _zero_rows_past_groups, grouped_gemm_ref, interpreting)
from moetrain.kernels.grouped_gemm_tuning import ROWGROUP_CONFIGS, GemmConfig, pick_config
from moetrain.kernels.host import rows_bucket
from moetrain.kernels.moe_rows import ACTIVATIONS, _activation


# The plain forward's candidates but those that spill registers on sm_90a with this epilogue
# (tests/kernels/test_grouped_gemm_sm90.py): the 4-warp 128x128 tiles (pointer loads; gathered rows with h
# stored by TMA), and the pointer-path 2-per-SM one.
FC1_SWIGLU_CONFIGS = tuple(c for c in ROWGROUP_CONFIGS if not (c.block_m == c.block_n == 128 and c.num_warps == 4
                                                               and (c.programs_per_sm == 1 or not c.use_tma)))


def fc1_swiglu_ref(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, activation: str = "swiglu",
                   probs: torch.Tensor | None = None, gather_rows: torch.Tensor | None = None):
    """(h [M, 2I], a [M, I]) by the plain references, in x's dtype."""
    from moetrain.ops.moe_rows import swiglu_torch

    if gather_rows is not None:
        x = x.index_select(0, gather_rows.long())
    h = grouped_gemm_ref(x, w1, offs)
    a = swiglu_torch(h, activation)
    if probs is not None:
        a = (a * probs.unsqueeze(1)).to(a.dtype)
    return h, a


@triton.jit(do_not_specialize=["M", "G", "NUM_PROGS"])
def _fc1_swiglu_kernel(
    a_ptr, a_desc,  # A [M, H]; a_desc 2-D, block [BLOCK_M, BLOCK_K] (GATHER: A is [T, H], rows gathered)
    gather_ptr,  # GATHER: [M] int32 source row of each A row
    w_ptr, wg_desc, wu_desc,  # w1 [G, 2I, H]; gate / up halves: 3-D [G, I, H] descriptors, block [1, BLOCK_N, BLOCK_K]
    wp_desc,  # PAIRED: w1 as 4-D [G, 2, I, H], block [1, 2, BLOCK_N, BLOCK_K]: gate and up rows j in one box
    h_ptr, act_ptr, probs_ptr,  # h [M, 2I], a [M, I], probs [M] fp32 (HAS_PROBS)
    hg_desc, hu_desc,  # TMA_H: h's gate and up halves as ragged 4-D descriptors, block [1, 1, BLOCK_M, BLOCK_N]
    offs_ptr,  # [G] int32
    M, I, RED, G,
    stride_am, stride_wg, stride_w1,
    NUM_PROGS,
    ACT: tl.constexpr, HAS_PROBS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_G: tl.constexpr, USE_TMA: tl.constexpr, FLATTEN: tl.constexpr, PRECISION: tl.constexpr,
    GATHER: tl.constexpr, PART: tl.constexpr, BIG_M: tl.constexpr,
    PAIRED: tl.constexpr,  # one [BLOCK_M, 2 BLOCK_N] accumulator (the plain forward's MMA shape), else two
    TMA_H: tl.constexpr,  # h stored by TMA (the plain forward's store), else from registers
):
    pid = tl.program_id(0)
    out_dtype = h_ptr.dtype.element_ty
    ends, tile_ends, total, n_tiles = _row_tiles(offs_ptr, M, I, G, BLOCK_M, BLOCK_N, BLOCK_G, PART, BIG_M)
    k_tiles = (RED + BLOCK_K - 1) // BLOCK_K
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)

    for tile in tl.range(pid, total, NUM_PROGS, flatten=FLATTEN):
        g, m0, n0, row_end = _tile_at(tile, ends, tile_ends, M, n_tiles, BLOCK_M, BLOCK_N, GROUP_M, PART, BIG_M)
        w_base = w_ptr + g.to(tl.int64) * stride_wg
        row_ok = (m0 + rm) < row_end
        col_ok = (n0 + rn) < I
        a_rows = _a_rows(a_ptr, gather_ptr, m0, rm, row_ok, stride_am, GATHER)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)  # PAIRED: gate columns, then up columns
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            k_ok = (k0 + rk) < RED
            if USE_TMA and not GATHER:
                a = a_desc.load([m0, k0])  # rows past the group's end only feed rows the stores drop
            else:
                a = tl.load(a_rows + (k0 + rk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if PAIRED:
                if USE_TMA:  # the box's two planes: gate rows n0.., up rows I + n0.. (zero past I in each)
                    b = wp_desc.load([g, 0, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
                else:
                    rp = tl.arange(0, 2 * BLOCK_N)
                    j = n0 + rp % BLOCK_N
                    b = tl.load(w_base + ((rp // BLOCK_N) * I + j)[None, :] * stride_w1 + (k0 + rk)[:, None],
                                mask=k_ok[:, None] & (j < I)[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            else:
                if USE_TMA:  # each half's descriptor zero-fills past I: no up row is read as a gate row
                    bg = wg_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
                    bu = wu_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b_mask = k_ok[:, None] & col_ok[None, :]
                    b_at = w_base + (n0 + rn)[None, :] * stride_w1 + (k0 + rk)[:, None]
                    bg = tl.load(b_at, mask=b_mask, other=0.0)
                    bu = tl.load(b_at + I * stride_w1, mask=b_mask, other=0.0)
                acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)

        if PAIRED:
            hg, hu = tl.split(tl.permute(tl.reshape(acc.to(out_dtype), [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
        else:
            hg = acc_g.to(out_dtype)
            hu = acc_u.to(out_dtype)
        mask = row_ok[:, None] & col_ok[None, :]
        rows = (m0 + rm).to(tl.int64)
        if TMA_H:  # the hardware clips each store at the group's row end and at I
            hg_desc.store([RAGGED, row_end, RAGGED - row_end + m0, n0], hg.reshape(1, 1, BLOCK_M, BLOCK_N))
            hu_desc.store([RAGGED, row_end, RAGGED - row_end + m0, n0], hu.reshape(1, 1, BLOCK_M, BLOCK_N))
        else:
            h_at = h_ptr + rows[:, None] * (2 * I) + (n0 + rn)[None, :]
            tl.store(h_at, hg, mask=mask)
            tl.store(h_at + I, hu, mask=mask)
        act = _activation(hg.to(tl.float32), hu.to(tl.float32), ACT)  # from h as stored (the separate kernel's input)
        if HAS_PROBS:
            act = act * tl.load(probs_ptr + m0 + rm, mask=row_ok, other=0.0)[:, None]
        tl.store(act_ptr + rows[:, None] * I + (n0 + rn)[None, :], act.to(out_dtype), mask=mask)

    _zero_rows_past_groups(h_ptr, ends, M, 2 * I, 2 * I, pid, NUM_PROGS, BLOCK_M, 2 * BLOCK_N, PART)
    _zero_rows_past_groups(act_ptr, ends, M, I, I, pid, NUM_PROGS, BLOCK_M, BLOCK_N, PART)


def fc1_swiglu(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, activation: str = "swiglu",
               probs: torch.Tensor | None = None, *, gather_rows: torch.Tensor | None = None,
               config: GemmConfig | None = None, out: tuple | None = None, num_programs: int | None = None,
               paired: bool = True, tma_h: bool = True):
    """(h [M, 2I], a [M, I]) in x's dtype: FC1 and SwiGLU in one kernel (see the module docstring).

    x [M, H] (or [T, H] with gather_rows [M] int32/int64: row r is x[gather_rows[r]]), w1 [G, 2I, H] same dtype,
    offs [G] int32 on x's device, probs [M] fp32 or None. ``config`` is a plain forward config (block_n = the
    two accumulators' columns together) and bypasses the autotuner; ``out`` = (h, a), contiguous, receives the
    results. ``paired``: gate and up rows in one B tile and one accumulator (one MMA of the plain forward's
    shape), else two accumulators (two MMAs of half the width: session 7 measured that ~40% slower at Mixtral).
    ``tma_h`` (default): h's halves stored by TMA as the plain forward stores its output (two [BLOCK_M, BLOCK_N]
    buffers in shared memory: 213 KB at 128x256x64/s3, the plain forward's), else from registers (the variant
    session 7 measured).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown expert activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
    if x.dim() != 2 or w1.dim() != 3 or x.shape[1] != w1.shape[2] or w1.shape[1] % 2 or offs.shape != (w1.shape[0],):
        raise ValueError(f"fc1_swiglu: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, offs {tuple(offs.shape)} must be "
                         "[M, H], [G, 2I, H], [G]")
    if x.dtype != w1.dtype:
        raise ValueError(f"fc1_swiglu: dtypes differ ({x.dtype}, {w1.dtype})")
    _check_device(x, w1, offs)
    x, w1 = x.contiguous(), w1.contiguous()
    offs = offs.to(torch.int32).contiguous()
    M = x.shape[0]
    if gather_rows is not None:
        if gather_rows.dim() != 1:
            raise ValueError(f"fc1_swiglu: gather_rows {tuple(gather_rows.shape)} must be [M]")
        _check_device(x, gather_rows)
        gather_rows = gather_rows.to(torch.int32).contiguous()
        M = gather_rows.shape[0]
    if probs is not None:
        if probs.shape != (M,) or probs.dtype != torch.float32:
            raise ValueError(f"fc1_swiglu: probs {tuple(probs.shape)} {probs.dtype} must be [M] = [{M}] float32")
        _check_device(x, probs)
        probs = probs.contiguous()
    G, two_i, RED = w1.shape
    inter = two_i // 2
    h, act = (None, None) if out is None else out
    h, act = _output(h, (M, two_i), x), _output(act, (M, inter), x)
    if M == 0 or inter == 0:
        return h, act
    if G == 0 or RED == 0:
        return h.zero_(), act.zero_()
    up = w1[:, inter:, :]
    tma_ok = (_tma_ok(x, w1, h) and up.data_ptr() % 16 == 0 and M < RAGGED_ROWS)
    h_halves = (h[:, :inter], h[:, inter:])

    def launch(cfg: GemmConfig, part: int, big_m: int):
        use_tma = cfg.use_tma and tma_ok
        bm, bn, bk = cfg.block_m, cfg.block_n // 2, cfg.block_k
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor
            a_desc = x if gather_rows is not None else TensorDescriptor(x, [M, RED], [RED, 1], [bm, bk])
            wg_desc = TensorDescriptor(w1, [G, inter, RED], [two_i * RED, RED, 1], [1, bn, bk])
            wu_desc = TensorDescriptor(up, [G, inter, RED], [two_i * RED, RED, 1], [1, bn, bk])
            wp_desc = TensorDescriptor(w1, [G, 2, inter, RED], [two_i * RED, inter * RED, RED, 1], [1, 2, bn, bk])
        else:
            a_desc, wg_desc, wu_desc, wp_desc = x, w1, w1, w1
        store_h = use_tma and tma_h and h_halves[1].data_ptr() % 16 == 0
        hg_desc, hu_desc = (_ragged_desc(t, [bm, bn]) for t in h_halves) if store_h else (h, h)
        nprog = _row_programs(x.device, cfg, M, G, inter, bn, part, num_programs)
        _fc1_swiglu_kernel[(nprog,)](
            x, a_desc, gather_rows if gather_rows is not None else offs, w1, wg_desc, wu_desc, wp_desc, h, act,
            probs if probs is not None else h, hg_desc, hu_desc, offs, M, inter, RED, G,
            x.stride(0), w1.stride(0), w1.stride(1), nprog,
            ACT=ACTIVATIONS[activation], HAS_PROBS=probs is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, BLOCK_G=_block_g(G), USE_TMA=use_tma,
            FLATTEN=not interpreting(), PRECISION=_precision(x.dtype), GATHER=gather_rows is not None,
            PART=part, BIG_M=big_m, PAIRED=paired, TMA_H=store_h, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)

    def run(cfg: GemmConfig):
        _run_tail_split(cfg, launch)

    op = "fc1_swiglu" + ("_gather" if gather_rows is not None else "")
    key = (op, x.dtype, x.device, inter, RED, rows_bucket(M, G), tma_ok, activation, probs is not None, paired, tma_h)
    with _on_device(x.device):
        run(pick_config(key, FC1_SWIGLU_CONFIGS, config, run))
    return h, act
