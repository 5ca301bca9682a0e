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
  TMA store that the hardware clips at the group's end (see RAGGED in grouped_gemm_kernels.py).
- wgrad (`_wgrad_kernel`): the tiles are the BLOCK_M x BLOCK_N tiles of every dw[g]; the
  reduction runs over the group's rows (variable K), so the (tile, row chunk) loop is flattened
  by hand into one pipelined loop. Tiles run in bands of GROUP_N dw row tiles (config group_m),
  column-major inside a band (1: row-major); on DeepSeek-V3's layouts, big experts included, bands
  of 1-16 timed within noise of each other (bench/archive/2026-11-29_1205-1455.md).
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
- Tuning (moetrain.tuning): with no explicit config, the first call per (op, dtype, N, K, M/G bucket) times every
  candidate config of grouped_gemm_configs on the caller's and a skewed routing and keeps the fastest on the sum;
  with ``with_torch`` (the "auto" backend), torch._grouped_mm's form of the op is a candidate too, and a config must
  be at least as fast as torch on both routings to be preferred over one that is faster on the sum only.
"""

from __future__ import annotations

import functools

import torch

from moetrain.runtime import cuda_device
from moetrain.kernels.grouped_gemm_kernels import (RAGGED_ROWS, _rowgroup_kernel, _wgrad_kernel, ragged_geometry,
                                                   block_g as _block_g)
from moetrain.kernels.host import cdiv
from moetrain.kernels.launch import launch
from moetrain.kernels.schedule import skew_schedule
from moetrain.kernels.torch_grouped_mm import torch_grouped_mm

from moetrain.kernels.grouped_gemm_configs import (  # noqa: F401  (GemmConfig, configs_for: public API)
    INTERPRETER_CONFIG, INTERPRETER_PROGRAMS, PINGPONG_ROWGROUP_CONFIGS, PINGPONG_WGRAD_CONFIGS, ROWGROUP_CONFIGS,
    TORCH, WGRAD_CONFIGS, GemmConfig, configs_for, interpreter_numpy_shim, interpreting, tail_config)
from moetrain import tuning

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
    """4-D "ragged" descriptor of a 2-D tensor (grouped_gemm_kernels.RAGGED); rows must be < 2^30."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, *ragged_geometry(t.shape[1], t.stride(0)), [1, 1, *block])


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


_on_device = cuda_device.on_device  # (the launchers' name for it)


def _row_programs(device: torch.device, cfg: GemmConfig, M: int, G: int, OUT: int, block_n: int, part: int,
                  num_programs: int | None) -> int:
    """Persistent grid of a row-group launch (``cfg`` the launched config): programs_per_sm per SM, or num_programs,
    at most the tile count's bound without reading offs (every group adds at most one partial row tile; a tail
    launch, PART 2, has at most one tile row per group)."""
    bound = (cdiv(M, cfg.block_m) + G) * cdiv(OUT, block_n) if part != 2 else G * cdiv(OUT, block_n)
    return max(1, min(num_programs or _num_programs(device) * cfg.programs_per_sm, bound))


def _run_tail_split(cfg: GemmConfig, launch_part, tail=tail_config) -> None:
    """``launch_part(config, part, big_m)`` once (PART 0), or for a tail-split config the body (PART 1) and then the
    half-height tail (PART 2, ``tail(cfg)``): see TAIL SPLIT."""
    if not cfg.tail_split:
        launch_part(cfg, 0, cfg.block_m)
        return
    launch_part(cfg, 1, cfg.block_m)
    launch_part(tail(cfg), 2, cfg.block_m)


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
                     num_programs: int | None = None, with_torch: bool = False) -> torch.Tensor:
    """Forward: y [M, N] = x_g @ w[g]^T per group; rows past offs[-1] are 0.

    x [M, K], w [G, N, K] (same dtype: bf16/fp16/fp32), offs [G] int32 cumulative row ends on
    x's device. Returns y [M, N] in x's dtype (fp32 accumulation).
    gather_rows [M] int32/int64 (optional): row r of the grouped operand is x[gather_rows[r]],
    with x [T, K] the unpermuted token rows (the permuted copy is never materialized).
    ``config`` bypasses the tuner; ``out`` (contiguous [M, N]) receives the result;
    ``num_programs`` overrides the persistent grid size (default: programs_per_sm per SM);
    ``with_torch``: torch._grouped_mm is a candidate of the tuner too (backend "auto"; not with gather_rows).
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or offs.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm_fwd: x {tuple(x.shape)}, w {tuple(w.shape)}, offs {tuple(offs.shape)} "
                         "must be [M,K], [G,N,K], [G]")
    if gather_rows is not None and gather_rows.dim() != 1:
        raise ValueError(f"grouped_gemm_fwd: gather_rows {tuple(gather_rows.shape)} must be [M]")
    return _rowgroup(x, w, offs, False, config, out, num_programs, gather_rows, with_torch)


def grouped_gemm_dgrad(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, config: GemmConfig | None = None,
                       out: torch.Tensor | None = None, num_programs: int | None = None,
                       with_torch: bool = False) -> torch.Tensor:
    """Data gradient: dx [M, K] = dy_g @ w[g] per group; rows past offs[-1] are 0.

    dy [M, N], w [G, N, K] (same dtype), offs [G] int32. Returns dx [M, K] in dy's dtype.
    Same kernel as the forward, with w read as [N, K] (no transposed copy of w). Keywords as the forward's.
    """
    if dy.dim() != 2 or w.dim() != 3 or dy.shape[1] != w.shape[1] or offs.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm_dgrad: dy {tuple(dy.shape)}, w {tuple(w.shape)}, offs {tuple(offs.shape)} "
                         "must be [M,N], [G,N,K], [G]")
    return _rowgroup(dy, w, offs, True, config, out, num_programs, None, with_torch)


def _rowgroup(a, w, offs, dgrad, config, out, num_programs, gather=None, with_torch=False):
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
    if M == 0 or OUT == 0:
        return _output(out, (M, OUT), a)
    if G == 0 or RED == 0:
        return _output(out, (M, OUT), a).zero_()
    # out is checked before it exists: torch.empty's allocations are aligned, its rows OUT elements long
    out_ok = _tma_ok(out) if out is not None else (OUT * a.element_size()) % 16 == 0
    tma_ok = _tma_ok(a, w) and out_ok and M < RAGGED_ROWS
    pingpong_ok = tma_ok and gather is None and pingpong_applies(a)
    op = "dgrad" if dgrad else ("fwd_gather" if gather is not None else "fwd")
    if config is None and interpreting():
        config = INTERPRETER_CONFIG
    if config is None:
        candidates = ((TORCH,) if with_torch and gather is None else ()) + ROWGROUP_CONFIGS + (
            PINGPONG_ROWGROUP_CONFIGS if pingpong_ok else ())

        def run_with(cand, routing):
            _rowgroup(a, w, routing, dgrad, cand, None, num_programs, gather)
        with _on_device(a.device):
            config = _tuned(op, a, M, G, OUT, RED, (tma_ok, pingpong_ok), candidates, run_with, offs)
    if config == TORCH:
        y = torch_grouped_mm(op, a, w, offs)
        return y if out is None else out.copy_(y)
    out = _output(out, (M, OUT), a)
    if config.kernel == "pingpong" and not pingpong_ok:
        raise ValueError(f"grouped GEMM: config {config} needs a Hopper GPU, bf16, TMA-aligned tensors and rows not "
                         "gathered")

    def launch_part(cfg: GemmConfig, part: int, big_m: int, sched: torch.Tensor, offs: torch.Tensor):
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
        launch(_rowgroup_kernel, (nprog,),
            a, a_desc, offs if gather is None else gather, w, w_desc, out, out_desc, offs, sched, M, OUT, RED, G,
            a.stride(0), w.stride(0), w.stride(1), out.stride(0), nprog,
            DGRAD=dgrad, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
            BLOCK_G=_block_g(G), USE_TMA=use_tma,
            FLATTEN=not interpreting(), PRECISION=_precision(a.dtype), GATHER=gather is not None,
            PART=part, BIG_M=big_m, MIX=cfg.mix, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def run(cfg: GemmConfig):
        if cfg.kernel == "pingpong":
            from moetrain.kernels.rowgroup_pingpong import grouped_gemm_rowgroup_pingpong

            grouped_gemm_rowgroup_pingpong(a, w, offs, dgrad=dgrad, stages=cfg.num_stages, group_m=cfg.group_m,
                                           tile=(cfg.block_m, cfg.block_n), out=out, num_programs=num_programs)
            return
        sched = skew_schedule(offs) if cfg.mix else offs  # (unused without MIX)
        _run_tail_split(cfg, lambda c, part, big_m: launch_part(c, part, big_m, sched, offs))

    with _on_device(a.device):
        run(config)
    return out


def _tuned(op: str, a: torch.Tensor, m: int, g: int, n: int, k: int, variant: tuple, candidates: tuple, run_with,
           offs: torch.Tensor):
    """The tuner's candidate for one grouped GEMM of m rows over g groups (n output, k reduction columns).
    ``run_with(candidate, offs)`` runs the op; each candidate is timed on the caller's routing
    and on a skewed one of the same rows (runtime.timing.skewed_offs, made only when the tuner times): the key
    cannot see skew without a host sync, the first call's routing is near-uniform and training's skews later, and
    a config can lead on balanced routing yet collapse on skewed (the ping-pong weight gradient)."""
    made = []

    def run_skewed(cand):
        if not made:
            from moetrain.runtime.timing import skewed_offs

            made.append(skewed_offs(m, g, 0, a.device))
        return run_with(cand, made[0])

    peer = TORCH if candidates[0] == TORCH else None
    kind = f"gemm_{op}" + ("+torch" if peer else "")
    return tuning.choose(kind, a, n, k, m, g, candidates, (lambda cand: run_with(cand, offs), run_skewed),
                         variant=variant, peer=peer)


def grouped_gemm_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, *, gather_rows: torch.Tensor | None = None,
                       config: GemmConfig | None = None, out: torch.Tensor | None = None,
                       num_programs: int | None = None, with_torch: bool = False) -> torch.Tensor:
    """Weight gradient (variable-K grouped GEMM): dw [G, N, K] = dy_g^T @ x_g per group.

    dy [M, N], x [M, K] (same dtype), offs [G] int32. Returns dw [G, N, K] in dy's dtype; groups
    with no rows get zeros; rows past offs[-1] do not contribute. On the TMA path, rows of other
    groups that share a row chunk are multiplied by exact zeros, so they must be finite.
    gather_rows [M] int32/int64 (optional): row r of the grouped x operand is x[gather_rows[r]], with
    x [T, K] the unpermuted token rows (the permuted copy is never materialized; x by pointer loads).
    ``config``, ``out``, ``num_programs``, ``with_torch``: as the forward's.
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
    if G == 0 or N == 0 or K == 0:
        return _output(out, (G, N, K), dy)
    if M == 0:
        return _output(out, (G, N, K), dy).zero_()
    # a dw made by torch.empty is aligned, and its row stride K is x's (checked)
    tma_ok = _tma_ok(dy, x) and (out is None or _tma_ok(out)) and M < RAGGED_ROWS
    pingpong_ok = tma_ok and pingpong_applies(dy) and (gather_rows is None or K % 128 == 0)
    op = "wgrad" if gather_rows is None else "wgrad_gather"
    if config is None and interpreting():
        config = INTERPRETER_CONFIG
    if config is None:
        # (the gathered ping-pong configs are on trial: explicit configs only)
        candidates = ((TORCH,) if with_torch and gather_rows is None else ()) + WGRAD_CONFIGS + (
            PINGPONG_WGRAD_CONFIGS if pingpong_ok and gather_rows is None else ())

        def run_with(cand, routing):
            grouped_gemm_wgrad(dy, x, routing, gather_rows=gather_rows, config=cand, num_programs=num_programs)
        with _on_device(dy.device):
            config = _tuned(op, dy, M, G, N, K, (tma_ok, pingpong_ok), candidates, run_with, offs)
    if config == TORCH:
        dw = torch_grouped_mm(op, dy, x, offs)
        return dw if out is None else out.copy_(dw)
    out = _output(out, (G, N, K), dy)
    if config.kernel == "pingpong" and not pingpong_ok:
        raise ValueError(f"grouped_gemm_wgrad: config {config} needs a Hopper GPU, bf16 and TMA-aligned tensors "
                         "(with gathered rows, K a multiple of 128)")

    def run(cfg: GemmConfig):
        if cfg.kernel == "pingpong":
            from moetrain.kernels.wgrad_pingpong import grouped_gemm_wgrad_pingpong

            grouped_gemm_wgrad_pingpong(dy, x, offs, stages=cfg.num_stages, group_n=cfg.group_m,
                                        tile=(cfg.block_m, cfg.block_n), gather_rows=gather_rows, out=out,
                                        num_programs=num_programs, cohorts=cfg.cohorts, mix=cfg.mix,
                                        sorted_groups=cfg.sorted_groups)
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
        launch(_wgrad_kernel, (nprog,),
            dy, dy_desc, x, x_desc, gather_rows if gather_rows is not None else offs, out, dw_desc, offs, M, N, K, G,
            dy.stride(0), x.stride(0), out.stride(0), out.stride(1), nprog,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=cfg.group_m, BLOCK_G=_block_g(G),
            USE_TMA=use_tma, PRECISION=_precision(dy.dtype), GATHER=gather_rows is not None, TMA_STORE=cfg.tma_store,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    with _on_device(dy.device):
        run(config)
    return out


def pingpong_applies(dy: torch.Tensor) -> bool:
    """Whether the ping-pong kernels (wgrad_pingpong.py, rowgroup_pingpong.py) can run on dy's device and dtype:
    compiled kernels (not the interpreter) on a Hopper GPU, bf16, and a triton with Gluon. The caller checks TMA
    alignment."""
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
