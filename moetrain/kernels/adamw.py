"""Multi-tensor AdamW and gradient sum-of-squares kernels: one launch per dtype combination covers every tensor of it,
each element read once and written once (reference: ``moetrain.train.optim.adamw_reference``, the optimizer's
explicit per-tensor path; where every dtype agrees, ``torch._fused_adamw_``).

Shapes and dtypes (n tensors of any shapes, contiguous; each row's tensors have one numel):
    TensorTable.build(columns, flags, chunk)  columns: up to 5 lists of n tensors (or None: that column absent)
                                              -> a device int64 table [n + 1, 8] (see TABLE below)
    adamw_update(table, step, lr, ...)        columns (target, grad, exp_avg, exp_avg_sq[, copy]): target fp32/bf16/
                                              fp16 updated in place (an fp32 master or the parameter itself), grad
                                              any of those, the moments any of those, updated in place; copy: the
                                              16-bit parameter written with the rounded (RNE) new target. step,
                                              lr: fp32 [] on the device; grad_scale fp32 [] (grads / grad_scale);
                                              found_inf fp32 [] (nonzero: nothing is written)
    grad_sq_norms(table, out)                 column 0: the gradients -> out fp32 [n]: each one's sum of squares

The update, per element, in fp32 (torch._fused_adamw_'s definition: ATen's fused_adam_utils.cuh):
    g = grad / grad_scale;  w = w - lr * wd * w  (wd: weight_decay where the row's flag says decay, else 0)
    m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
    w = w - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),  bc1 = 1 - beta1 ** step, bc2 = 1 - beta2 ** step
The bias corrections are computed in fp64 (as torch does: 1 - beta2 ** step cancels to ~1e-3 at step 1, where fp32
powers would lose 4-5 digits); divisions and the square root are IEEE-rounded (div_rn, sqrt_rn), as in CUDA code
built without fast math.

Layout (why a table and a persistent grid): torch's multi_tensor_apply passes tensor addresses and a chunk map in the
kernel's argument space, which holds a few dozen tensors and a few hundred chunks per launch, so 13.5 B parameters
take hundreds of launches. Here the addresses live in a device table with one row per tensor (O(tensors), copied to
the device only when an address changes), one launch per dtype combination covers every tensor, and a persistent
grid of programs strides over the chunks of all tensors; a program finds a chunk's tensor by a binary search over
the rows' first-chunk column (log2(n) cached loads per chunk of CHUNK elements). Full chunks load and store
unmasked (the 16-byte aligned case vectorizes to 128-bit accesses); a tensor's last chunk is masked.

TABLE row t: [address of column 0, .., column 4 (0 where absent), numel, flag (AdamW: 1 = decay), first chunk];
row n: [0, .., 0, total chunks].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moetrain.kernels.grouped_gemm_configs import interpreter_numpy_shim, interpreter_rounding_shim, interpreting
from moetrain.kernels.host import cdiv
from moetrain.kernels.launch import launch

COLS = tl.constexpr(8)  # int64 per table row
NUMEL, FLAG, START = tl.constexpr(5), tl.constexpr(6), tl.constexpr(7)  # their columns
MAX_COLUMNS = 5


@dataclass(frozen=True)
class Tile:
    """How a launch splits the work. A chunk (``chunk`` elements, the unit a program takes; a table is built for one
    chunk size) is done in vector steps of ``block`` = ``warps`` x 32 threads x ``per_thread`` elements (4: one
    128-bit access per fp32 tensor, 64 bits per 16-bit one). Each thread gets at most ``max_registers`` (Triton's
    maxnreg), which fixes how many programs an SM holds at once (65536 registers, 2048 threads), and the
    persistent grid is that many programs per SM: one wave, no straggling second one. Compiled for sm_90a the
    default needs no spills in any dtype combination (tests/kernels/test_adamw_sm90.py). ``cpu_programs``: the
    grid under the CPU interpreter."""

    warps: int = 8
    per_thread: int = 4
    max_registers: int = 64
    chunk: int = 16384
    cpu_programs: int = 4

    @property
    def block(self) -> int:
        block = self.warps * 32 * self.per_thread
        if self.chunk % block:
            raise ValueError(f"Tile: a chunk of {self.chunk} elements is not a whole number of {block}-element blocks")
        return block

    @property
    def programs_per_sm(self) -> int:
        threads = self.warps * 32
        return max(1, min(2048 // threads, 65536 // (self.max_registers * threads)))


DEFAULT_TILE = Tile()
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class TensorTable:
    """A device table of ``n`` tensor rows (module doc), the dtype of each column (None: absent), the chunk size it
    was built for, its total chunk count and whether every address is 16-byte aligned."""

    table: torch.Tensor  # int64 [n + 1, COLS] on the tensors' device
    n: int
    dtypes: tuple
    chunk: int
    total_chunks: int
    aligned: bool

    @staticmethod
    def build(columns: list[list[torch.Tensor] | None], flags: list[int] | None = None,
              chunk: int = DEFAULT_TILE.chunk) -> TensorTable:
        """The table of n rows from ``columns`` (each a list of n contiguous tensors of one dtype, or None), every
        row's tensors of one numel and device; ``flags``: one int per row (default 0). Rows of no elements are
        left out (nothing to do), so ``n`` counts the others; the caller maps outputs with ``kept_rows``."""
        present = [c for c in columns if c is not None]
        if not present or len(columns) > MAX_COLUMNS:
            raise ValueError(f"TensorTable: 1 to {MAX_COLUMNS} columns, at least one present")
        rows, device = len(present[0]), present[0][0].device if present[0] else torch.device("cpu")
        dtypes = tuple(None if c is None else _column_dtype(c) for c in columns)
        flags = flags if flags is not None else [0] * rows
        out, start, aligned = [], 0, True
        for r in range(rows):
            tensors = [c[r] for c in present]
            numel = _check_row(tensors, device, r)
            if numel == 0:
                continue
            addresses = [0 if c is None else c[r].data_ptr() for c in columns]
            aligned = aligned and all(a % 16 == 0 for a in addresses)
            out.append(addresses + [0] * (MAX_COLUMNS - len(columns)) + [numel, int(flags[r]), start])
            start += cdiv(numel, chunk)
        out.append([0] * int(START) + [start])
        return TensorTable(_to_device(out, device), len(out) - 1, dtypes, chunk, start, aligned)


def kept_rows(columns: list[list[torch.Tensor] | None]) -> list[int]:
    """The rows ``TensorTable.build`` keeps (those with elements), in order: output i belongs to row kept_rows[i]."""
    first = next(c for c in columns if c is not None)
    return [r for r, t in enumerate(first) if t.numel() > 0]


def _column_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _TL:
        raise ValueError(f"TensorTable: a column needs one dtype of {sorted(map(str, _TL))}; got "
                         f"{sorted(map(str, dtypes))}")
    return next(iter(dtypes))


def _check_row(tensors: list[torch.Tensor], device: torch.device, r: int) -> int:
    numel = tensors[0].numel()
    for t in tensors:
        if t.numel() != numel or t.device != device or not t.is_contiguous():
            raise ValueError(f"TensorTable row {r}: every tensor contiguous, of {numel} elements, on {device}; got "
                             f"{tuple(t.shape)} {t.device} contiguous={t.is_contiguous()}")
    return numel


def _to_device(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """The rows as int64 on ``device``: from pinned memory without a host sync on CUDA."""
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # the host allocator keeps it until the copy is done


def _programs(table: TensorTable, tile: Tile) -> int:
    """The persistent grid: the tile's programs per SM, never more than there are chunks."""
    if interpreting():
        interpreter_numpy_shim()
        interpreter_rounding_shim()
    device = table.table.device
    if device.type == "cuda":
        from moetrain.runtime.cuda_device import sm_count

        cap = sm_count(device) * tile.programs_per_sm
    else:
        cap = tile.cpu_programs
    return max(1, min(table.total_chunks, cap))


# ---- kernels ---------------------------------------------------------------------------------------------------


@triton.jit
def _find_row(table_ptr, c, n, search_steps):
    """The row whose chunks hold chunk ``c``: the last row t with first chunk <= c (row n's is the total)."""
    lo = n * 0
    hi = n
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go = tl.load(table_ptr + mid.to(tl.int64) * COLS + START) <= c
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _address(row_ptr, col: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    ptr = tl.load(row_ptr + col).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _load(ptr, offs, numel, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    else:
        return tl.load(ptr + offs).to(tl.float32)


@triton.jit
def _store(ptr, offs, value, numel, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=offs < numel)
    else:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty))


@triton.jit
def _one_minus_pow(beta, step):
    """1 - beta ** step in fp64 (beta fp64, step a non-negative integer): square and multiply, 32 bits of step."""
    power = tl.full((), 1.0, tl.float64)
    base = beta
    e = step
    for _ in range(32):
        power = tl.where((e & 1) != 0, power * base, power)
        base = base * base
        e = e >> 1
    return 1.0 - power


@triton.jit
def _adamw_chunk(target, grad, exp_avg, exp_avg_sq, copy, base, numel, decay_lr, step_size, bc2_sqrt, eps,
                 scale, BETA1: tl.constexpr, BETA2: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_COPY: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr):
    for b in range(CHUNK_BLOCKS):
        offs = base + b * BLOCK + tl.arange(0, BLOCK)
        g = _load(grad, offs, numel, MASKED)
        if HAS_SCALE:
            g = tl.div_rn(g, scale)
        w = _load(target, offs, numel, MASKED)
        m = _load(exp_avg, offs, numel, MASKED)
        v = _load(exp_avg_sq, offs, numel, MASKED)
        w = w - decay_lr * w
        m = BETA1 * m + (1.0 - BETA1) * g
        v = BETA2 * v + (1.0 - BETA2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        w = w - tl.div_rn(step_size * m, denom)
        _store(target, offs, w, numel, MASKED)
        _store(exp_avg, offs, m, numel, MASKED)
        _store(exp_avg_sq, offs, v, numel, MASKED)
        if HAS_COPY:
            _store(copy, offs, w, numel, MASKED)


@triton.jit
def _adamw_kernel(table_ptr, n, total_chunks, search_steps, step_ptr, lr_ptr, scale_ptr, inf_ptr, weight_decay, eps,
                  BETA1: tl.constexpr, BETA2: tl.constexpr, TARGET: tl.constexpr, GRAD: tl.constexpr,
                  EXP_AVG: tl.constexpr, EXP_AVG_SQ: tl.constexpr, COPY: tl.constexpr, HAS_SCALE: tl.constexpr,
                  HAS_INF: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr):
    """One persistent program: the step's scalars once, then every num_programs-th chunk (module doc)."""
    step = tl.load(step_ptr).to(tl.int32)
    bc1 = _one_minus_pow(tl.full((), BETA1, tl.float64), step).to(tl.float32)
    bc2_sqrt = tl.sqrt_rn(_one_minus_pow(tl.full((), BETA2, tl.float64), step).to(tl.float32))
    lr = tl.load(lr_ptr)
    step_size = tl.div_rn(lr, bc1)
    scale = tl.load(scale_ptr) if HAS_SCALE else 1.0
    end = total_chunks
    if HAS_INF:
        end = total_chunks * (tl.load(inf_ptr) == 0).to(tl.int32)  # a skipped step: no chunk is visited
    CHUNK: tl.constexpr = BLOCK * CHUNK_BLOCKS
    for c in range(tl.program_id(0), end, tl.num_programs(0)):
        row_ptr = table_ptr + _find_row(table_ptr, c, n, search_steps).to(tl.int64) * COLS
        numel = tl.load(row_ptr + NUMEL)
        base = (c - tl.load(row_ptr + START)).to(tl.int64) * CHUNK
        decay_lr = tl.where(tl.load(row_ptr + FLAG) != 0, lr * weight_decay, 0.0)
        target = _address(row_ptr, 0, TARGET, ALIGNED)
        grad = _address(row_ptr, 1, GRAD, ALIGNED)
        exp_avg = _address(row_ptr, 2, EXP_AVG, ALIGNED)
        exp_avg_sq = _address(row_ptr, 3, EXP_AVG_SQ, ALIGNED)
        copy = _address(row_ptr, 4, COPY if COPY is not None else TARGET, ALIGNED)
        if base + CHUNK <= numel:
            _adamw_chunk(target, grad, exp_avg, exp_avg_sq, copy, base, numel, decay_lr, step_size, bc2_sqrt, eps,
                         scale, BETA1, BETA2, HAS_SCALE, COPY is not None, False, BLOCK, CHUNK_BLOCKS)
        else:
            _adamw_chunk(target, grad, exp_avg, exp_avg_sq, copy, base, numel, decay_lr, step_size, bc2_sqrt, eps,
                         scale, BETA1, BETA2, HAS_SCALE, COPY is not None, True, BLOCK, CHUNK_BLOCKS)


@triton.jit
def _sq_chunk(grad, base, numel, MASKED: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float32)
    for b in range(CHUNK_BLOCKS):
        g = _load(grad, base + b * BLOCK + tl.arange(0, BLOCK), numel, MASKED)
        acc += g * g
    return tl.sum(acc, axis=0)


@triton.jit
def _sq_partials_kernel(table_ptr, n, total_chunks, search_steps, partial_ptr, GRAD: tl.constexpr,
                        ALIGNED: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr):
    """Each chunk's sum of squares of column 0 into partial[chunk] (persistent programs, as the update)."""
    CHUNK: tl.constexpr = BLOCK * CHUNK_BLOCKS
    for c in range(tl.program_id(0), total_chunks, tl.num_programs(0)):
        row_ptr = table_ptr + _find_row(table_ptr, c, n, search_steps).to(tl.int64) * COLS
        numel = tl.load(row_ptr + NUMEL)
        base = (c - tl.load(row_ptr + START)).to(tl.int64) * CHUNK
        grad = _address(row_ptr, 0, GRAD, ALIGNED)
        if base + CHUNK <= numel:
            s = _sq_chunk(grad, base, numel, False, BLOCK, CHUNK_BLOCKS)
        else:
            s = _sq_chunk(grad, base, numel, True, BLOCK, CHUNK_BLOCKS)
        tl.store(partial_ptr + c, s)


@triton.jit
def _row_sums_kernel(table_ptr, partial_ptr, out_ptr, BLOCK: tl.constexpr):
    """out[t] = the sum of row t's chunk partials, in a fixed order (the norm is the same bits every run)."""
    t = tl.program_id(0).to(tl.int64)
    first = tl.load(table_ptr + t * COLS + START)
    end = tl.load(table_ptr + (t + 1) * COLS + START)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(first, end, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + offs, mask=offs < end, other=0.0)
    tl.store(out_ptr + t, tl.sum(acc, axis=0))


# ---- host ------------------------------------------------------------------------------------------------------


def adamw_update(table: TensorTable, step: torch.Tensor, lr: torch.Tensor, beta1: float, beta2: float, eps: float,
                 weight_decay: float, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                 tile: Tile = DEFAULT_TILE) -> None:
    """One AdamW step over every row of ``table`` (columns target, grad, exp_avg, exp_avg_sq[, copy]; flag 1 =
    decay): see the module doc. step, lr, grad_scale, found_inf: fp32 [] on the table's device (nothing read on the
    host, so a CUDA graph may capture it); beta1 / beta2 are compiled in."""
    if table.chunk != tile.chunk:
        raise ValueError(f"adamw_update: the table was built for chunks of {table.chunk}, the tile's are {tile.chunk}")
    if len(table.dtypes) < 4 or any(d is None for d in table.dtypes[:4]):
        raise ValueError("adamw_update: the table needs the columns target, grad, exp_avg, exp_avg_sq")
    if table.n == 0:
        return
    copy = table.dtypes[4] if len(table.dtypes) > 4 else None
    target, grad, exp_avg, exp_avg_sq = (_TL[d] for d in table.dtypes[:4])
    launch(_adamw_kernel, (_programs(table, tile),), table.table, table.n, table.total_chunks, table.n.bit_length(),
           step, lr, grad_scale if grad_scale is not None else step, found_inf if found_inf is not None else step,
           float(weight_decay), float(eps), BETA1=float(beta1), BETA2=float(beta2), TARGET=target, GRAD=grad,
           EXP_AVG=exp_avg, EXP_AVG_SQ=exp_avg_sq, COPY=_TL[copy] if copy is not None else None,
           HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None, ALIGNED=table.aligned, BLOCK=tile.block,
           CHUNK_BLOCKS=tile.chunk // tile.block, num_warps=tile.warps, maxnreg=tile.max_registers)


def grad_sq_norms(table: TensorTable, out: torch.Tensor | None = None, tile: Tile = DEFAULT_TILE) -> torch.Tensor:
    """fp32 [n]: the sum of squares of each row's column-0 tensor, accumulated in fp32 (per chunk, then per row in a
    fixed order); written into ``out`` (fp32 [n], e.g. a slice of a longer vector) when given."""
    if table.chunk != tile.chunk:
        raise ValueError(f"grad_sq_norms: the table was built for chunks of {table.chunk}, the tile's are {tile.chunk}")
    device = table.table.device
    out = out if out is not None else torch.empty(table.n, dtype=torch.float32, device=device)
    if table.n == 0:
        return out
    partial = torch.empty(table.total_chunks, dtype=torch.float32, device=device)
    launch(_sq_partials_kernel, (_programs(table, tile),), table.table, table.n, table.total_chunks,
           table.n.bit_length(), partial, GRAD=_TL[table.dtypes[0]], ALIGNED=table.aligned, BLOCK=tile.block,
           CHUNK_BLOCKS=tile.chunk // tile.block, num_warps=tile.warps, maxnreg=tile.max_registers)
    launch(_row_sums_kernel, (table.n,), table.table, partial, out, BLOCK=1024, num_warps=4)
    return out
