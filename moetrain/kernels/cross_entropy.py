"""The fused loss's per-chunk elementwise work as Triton kernels (``ops.linear_cross_entropy``; reference: that
module's PyTorch path, ``_chunk`` on the CPU and for fp64).

Legend: C tokens of the chunk (rows), V vocabulary rows held here, b the logits' bytes (2 for bf16/fp16, 4 for
fp32; fp64 stays on the PyTorch path). z [C, V] in the inputs' dtype, rows contiguous (the logits GEMM's output),
labels [C] int64; a row is "valid" where its label != ignore_index and this rank "holds" its label where
vocab_start <= label < vocab_start + V. Every statistic is fp32, computed from the b-byte logits.

    row_stats(z, labels, ignore_index, vocab_start) -> (m, s, zt)    fp32 [C] each; reads z once: b bytes / logit
        m = max_j z[r, j], s = sum_j exp(z[r, j] - m) (one online pass: per block of the row the running max
        moves and the running sum is rescaled by exp(old max - new max)); zt = z[r, label - vocab_start] where
        this rank holds the label, else 0
    row_grad(z, labels, lse, ignore_index, vocab_start) -> None       writes over z; reads and writes z: 2b / logit
        z[r, j] = (exp(z[r, j] - lse[r]) - [j == label - vocab_start]) rounded once to z's dtype, 0 on ignored
        rows; lse [C] fp32 given (the vocab-parallel path combines the ranks' (m, s) into it between the kernels)
    row_fused(z, labels, ignore_index, vocab_start) -> (lse, zt)      writes over z; 3b / logit (without L2 hits)
        row_stats then row_grad in one program per row, lse = m + log(s) in between: one launch, no [C] round
        trip; the second pass walks the row backwards, so its first reads are the blocks the first pass read
        last, the likeliest still in L2 (a GPU timing decides how much that gives)

Ignored rows are not read: their statistics are m = 0, s = 1 (lse = 0), zt = 0, and their gradient rows are written
as zeros. The one-hot is subtracted in fp32 before the single rounding (as the reference's scatter_add before its
cast), and the softmax is exp(z - lse) where the reference computes exp(z - m) * exp(m - lse): the same fp32 value up
to a few fp32 ulps, so the b-byte gradients agree to within one ulp of their dtype.

Layout: one program per row (C programs), each looping over its row in blocks of ``block`` elements (V is up to ~200k
and never a multiple of the block in general: the last block is masked). The running max is a scalar (one block
reduction per step, one exp per element); the running sum is a vector of the block's lanes, summed once at the end.
Offsets are int64 (row * stride passes 2^31 at C * V > 2^31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetrain.kernels.grouped_gemm_configs import interpreter_numpy_shim, interpreter_rounding_shim, interpreting
from moetrain.kernels.launch import launch

# A program's block on the GPU: 4096 elements over 8 warps, 16 per thread (two 128-bit loads of bf16). Not tuned on
# a GPU yet. Under the CPU interpreter every block is a handful of numpy calls: 64 keeps the tests' rows multi-block.
BLOCK, WARPS = 4096, 8
INTERPRETER_BLOCK = 64
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- kernels ---------------------------------------------------------------------------------------------------


@triton.jit
def _label(labels_ptr, row, V, ignore_index, vocab_start):
    """(valid, holds, local): the row's label is not ignore_index; this rank holds it; its column here."""
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    local = label - vocab_start
    holds = valid & (local >= 0) & (local < V)
    return valid, holds, local


@triton.jit
def _max_sumexp(row_ptr, V, valid, BLOCK: tl.constexpr):
    """(m, s) of the row in fp32, one pass; (0, 1) for an ignored row, which is not read."""
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    end = tl.where(valid, V, 0)
    for start in range(0, end, BLOCK):
        cols = start + offs
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)  # exp(-inf) = 0: the first block, the masked lanes
        m = m_new
    return tl.where(valid, m, 0.0), tl.where(valid, tl.sum(s, axis=0), 1.0)


@triton.jit
def _label_logit(row_ptr, holds, local):
    """z[row, local] in fp32 where this rank holds the label, else 0 (never an out-of-row read)."""
    return tl.load(row_ptr + tl.where(holds, local, 0), mask=holds, other=0.0).to(tl.float32)


@triton.jit
def _write_grad(row_ptr, V, lse, valid, holds, local, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """z[row, :] = exp(z - lse) - onehot, rounded once to z's dtype; zeros on an ignored row (not read)."""
    offs = tl.arange(0, BLOCK)
    blocks = tl.cdiv(V, BLOCK)
    for i in range(0, blocks):
        if REVERSE:
            b = blocks - 1 - i
        else:
            b = i
        cols = b * BLOCK + offs
        inside = cols < V
        x = tl.load(row_ptr + cols, mask=inside & valid, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(holds & (cols == local), 1.0, 0.0)
        g = tl.where(valid, g, 0.0)
        tl.store(row_ptr + cols, g.to(row_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _stats_kernel(z_ptr, labels_ptr, m_ptr, s_ptr, zt_ptr, V, stride, ignore_index, vocab_start,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * stride
    valid, holds, local = _label(labels_ptr, row, V, ignore_index, vocab_start)
    m, s = _max_sumexp(row_ptr, V, valid, BLOCK)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(zt_ptr + row, _label_logit(row_ptr, holds, local))


@triton.jit
def _grad_kernel(z_ptr, labels_ptr, lse_ptr, V, stride, ignore_index, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    valid, holds, local = _label(labels_ptr, row, V, ignore_index, vocab_start)
    _write_grad(z_ptr + row * stride, V, tl.load(lse_ptr + row), valid, holds, local, BLOCK, False)


@triton.jit
def _fused_kernel(z_ptr, labels_ptr, lse_ptr, zt_ptr, V, stride, ignore_index, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * stride
    valid, holds, local = _label(labels_ptr, row, V, ignore_index, vocab_start)
    zt = _label_logit(row_ptr, holds, local)  # before the gradient is written over it
    m, s = _max_sumexp(row_ptr, V, valid, BLOCK)
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    tl.store(zt_ptr + row, zt)
    _write_grad(row_ptr, V, lse, valid, holds, local, BLOCK, True)


# ---- host ------------------------------------------------------------------------------------------------------


def _check(z: torch.Tensor, labels: torch.Tensor, block: int | None) -> int:
    """The block to use, after refusing what the kernels do not take."""
    if z.dim() != 2 or z.stride(1) != 1 or labels.shape != (z.shape[0],) or labels.dtype != torch.int64:
        raise ValueError(f"cross_entropy kernels: z [C, V] with unit column stride and labels [C] int64; got z "
                         f"{tuple(z.shape)} strides {z.stride()}, labels {tuple(labels.shape)} {labels.dtype}")
    if z.dtype not in DTYPES:
        raise ValueError(f"cross_entropy kernels: z must be bf16, fp16 or fp32 (fp64 stays on the PyTorch path); "
                         f"got {z.dtype}")
    if labels.device != z.device:
        raise ValueError(f"cross_entropy kernels: labels on {labels.device}, z on {z.device}")
    if interpreting():
        interpreter_numpy_shim()
        interpreter_rounding_shim()
    block = block or (BLOCK if z.is_cuda else INTERPRETER_BLOCK)
    if block < 1 or block & (block - 1):
        raise ValueError(f"cross_entropy kernels: block={block} must be a power of two")
    return block


def _warps(z: torch.Tensor, block: int) -> int:
    return max(1, min(WARPS, block // 512)) if z.is_cuda else 1


def row_stats(z: torch.Tensor, labels: torch.Tensor, ignore_index: int, vocab_start: int,
              block: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, zt) fp32 [C] of the chunk's logits z [C, V] (module docstring); z is only read."""
    block = _check(z, labels, block)
    C, V = z.shape
    m, s, zt = (torch.empty(C, dtype=torch.float32, device=z.device) for _ in range(3))
    if C:
        launch(_stats_kernel, (C,), z, labels, m, s, zt, V, z.stride(0), int(ignore_index), int(vocab_start),
               BLOCK=block, num_warps=_warps(z, block))
    return m, s, zt


def row_grad(z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ignore_index: int, vocab_start: int,
             block: int | None = None) -> None:
    """Writes the loss's gradient w.r.t. the logits over z [C, V], given each row's log-sum-exp lse fp32 [C]."""
    block = _check(z, labels, block)
    C, V = z.shape
    if lse.shape != (C,) or lse.dtype != torch.float32 or lse.device != z.device:
        raise ValueError(f"cross_entropy kernels: lse must be fp32 [{C}] on {z.device}; got {lse.dtype} "
                         f"{tuple(lse.shape)} on {lse.device}")
    if C:
        launch(_grad_kernel, (C,), z, labels, lse.contiguous(), V, z.stride(0), int(ignore_index), int(vocab_start),
               BLOCK=block, num_warps=_warps(z, block))


def row_fused(z: torch.Tensor, labels: torch.Tensor, ignore_index: int, vocab_start: int,
              block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, zt) fp32 [C], and the gradient written over z [C, V]: ``row_stats`` and ``row_grad`` in one launch (the
    whole vocabulary held here: no statistics to combine between them)."""
    block = _check(z, labels, block)
    C, V = z.shape
    lse, zt = (torch.empty(C, dtype=torch.float32, device=z.device) for _ in range(2))
    if C:
        launch(_fused_kernel, (C,), z, labels, lse, zt, V, z.stride(0), int(ignore_index), int(vocab_start),
               BLOCK=block, num_warps=_warps(z, block))
    return lse, zt
