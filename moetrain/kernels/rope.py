"""Fused RoPE, with the per-head RMSNorm before it where the model has one (Qwen3's q/k norm): Triton kernels, one
launch per tensor and direction. Their reference, plain PyTorch, is ``moetrain.ops.rope.rope_reference`` (the
models' RMSNorm then ``apply_rope``); the autograd op and the custom ops are in moetrain.ops.rope.

Legend: B batch, S sequence, h heads, D rotary dim (even; pairs (i, i + D/2): the "two halves" layout of
models.rope), R = B*S*h rows of D elements.

    rope_fwd(x, cos, sin, weight, eps)  x [B, S, h, D] bf16/fp16/fp32, any strides with the last dim contiguous
                                        (a view of a projection's output); cos, sin fp32 [S, D/2]
                                        (RopeParams.tables); weight [D] (any float dtype, read as fp32) or None
                                        -> y [B, S, h, D] contiguous in x's dtype, and with a weight rstd fp32
                                        [B, S, h] (the norm's 1 / sqrt(mean(x^2) + eps) per row)
    rope_bwd(dy, x, cos, sin, weight, rstd)
                                        dy [B, S, h, D] (any strides, last dim contiguous) -> dx [B, S, h, D]
                                        contiguous in dy's dtype, and with a weight dweight fp32 [D]; x and rstd
                                        (what the forward saved) are read only with a weight

Math, per row, in fp32 (x loaded and widened once, the result rounded once to x's dtype):
    n = x * rstd * w                 rstd = 1 / sqrt_rn(sum(x^2) / D + eps) (IEEE sqrt and divisions); without a
                                     weight n = x
    y1 = n1 * c - n2 * s,  y2 = n2 * c + n1 * s      (n1, n2 the halves; c, s the row's position's table entries)
Backward (R^T rotates back; xh = x * rstd):
    dn1 = dy1 * c + dy2 * s,  dn2 = dy2 * c - dy1 * s
    dweight = sum over rows of dn * xh;  g = dn * w;  dx = rstd * (g - xh * sum(g * xh) / D)
dweight is accumulated in fp32: each program of a persistent grid (a fixed number of programs for a device, at most
one per row block) sums its rows into one fp32 partial [D]; the host sums the partials (torch's reduction over a
fixed shape): the same bits on every run on a given GPU.

Where the fused kernel rounds differently from the eager path (``rope_reference``): eager normalises in fp32, rounds
n to x's dtype, then rotates in x's dtype (HF's order: the tables rounded to x's dtype, each product and the sum
rounded); the kernel keeps n and the rotation in fp32 with the fp32 tables and rounds y once. For fp32 tensors the
two agree up to the reduction order of sum(x^2) (and torch.rsqrt against the correctly rounded 1 / sqrt); for
16-bit tensors the kernel's y is the fp32 value rounded once (within half an ulp of x's dtype of the fp32 result),
eager's carries up to four roundings of x's dtype (tests/kernels/test_rope_fused.py bounds the difference). The
backward likewise rotates dy back in fp32 (eager: in x's dtype) and rounds dx once.

Kernels are compiled without floating-point contraction (``enable_fp_fusion=False``: no multiply-add fusion, as
PyTorch's eager element-wise ops do not fuse across ops), so a fp32 reference written in the kernel's order, given
the kernel's rstd, gives y's bits exactly on the GPU as in the interpreter; it costs nothing measurable in a kernel
bound by memory.

Bytes moved per element of x, for a GPU session to check (the kernels are bound by memory, so their times should
follow). Eager, counted with a TorchDispatchMode over the aten ops of the forward and of the backward (each op reads
its inputs and writes its outputs once; views free; tests/kernels/test_rope_fused.py recounts them), for bf16 x
[1, S, 64, 128] (Qwen3's q on one GPU) and a bf16 weight:
    eager, RMSNorm + RoPE (Qwen3's q and k):  forward 58 B in 18 launches (the norm's widening copy, x^2, mean,
                                              the rstd and weight products and the cast back: 40 B; RoPE's four
                                              products, two sums and the cat in bf16: 18 B), backward 124 B in 25
    eager, RoPE alone (Llama, GPT-OSS, MLA):  forward 18 B in 9 launches, backward 20 B in 8
    fused, with the norm:                     forward 2b = 4 B (read x, write y), backward 3b = 6 B (read dy and x,
                                              write dx); one launch each (+ the sum of the dweight partials)
    fused, RoPE alone:                        forward 4 B, backward 4 B; one launch each
with b = 2 the bytes of x's dtype; the fused kernels add, per element: the fp32 tables, read once per launch from
HBM (4 * S * D bytes: 4 / (B * h) B, 0.06 B at h = 64, and 4 B for MLA's shared key, h = 1, at B = 1; every row of
a position reads them from L2), rstd (4 / D B: 0.03 B at D = 128) written by the forward and read by the backward,
and the backward's dweight partials (programs x D fp32). Predicted: ~14x fewer bytes than eager forward and ~20x
backward with the norm, ~4.5x and ~5x for RoPE alone (h = 64).

Tiles (``RopeTile``): a program takes ``rows`` whole rows (both halves of each: the norm's sum needs the row);
2048 elements a program on 4 warps by default (16 a thread). Not tuned on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moetrain.kernels.grouped_gemm_configs import interpreter_numpy_shim, interpreter_rounding_shim, interpreting
from moetrain.kernels.host import cdiv, next_pow2, require_pow2
from moetrain.kernels.launch import launch
from moetrain.runtime import cuda_device

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RopeTile:
    """A program's work: ``rows`` rows of the flattened [R, D] at a time on ``warps`` warps; the backward with a
    weight runs at most ``programs_per_sm`` programs per SM (``cpu_programs`` under the interpreter), each walking
    every num_programs-th row block and keeping one fp32 dweight partial."""

    rows: int
    warps: int = 4
    programs_per_sm: int = 8
    cpu_programs: int = 3

    def __post_init__(self):
        require_pow2("RopeTile.rows", self.rows)
        require_pow2("RopeTile.warps", self.warps)


def rope_tile(dim: int) -> RopeTile:
    """The default program for rotary dim ``dim``: 2048 elements (rows of the padded width 2 * next_pow2(D / 2))."""
    return RopeTile(rows=max(1, 2048 // (2 * next_pow2(dim // 2))))


# ---- kernels ---------------------------------------------------------------------------------------------------


@triton.jit
def _rows(S, HEADS, BLOCK_R: tl.constexpr, block):
    """This row block's row ids r = (b * S + s) * HEADS + head and their (b, s, head), int32 (the host checks
    R + BLOCK_R < 2^31): one division and two remainders per row, in 32 bits."""
    r = tl.arange(0, BLOCK_R) + block * BLOCK_R
    bs = r // HEADS
    return r, bs // S, bs % S, r % HEADS


@triton.jit
def _offsets(b, pos, head, sb, ss, sh):
    """int64 offsets of rows (b, pos, head) in a tensor of strides (sb, ss, sh, 1)."""
    return b.to(tl.int64) * sb + pos.to(tl.int64) * ss + head.to(tl.int64) * sh


@triton.jit
def _halves(ptr, at, mask, HALF: tl.constexpr):
    """The two halves [BLOCK_R, BLOCK_H] of the rows at offsets ``at`` [BLOCK_R, BLOCK_H], widened to fp32."""
    first = tl.load(ptr + at, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _rope_fwd_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, y_ptr, rstd_ptr, rows, S, HEADS, sxb, sxs, sxh, eps,
                     HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program i: rows i*BLOCK_R.. of y = rope(rmsnorm(x)) (module doc), y contiguous [R, 2*HALF]."""
    r, b, pos, head = _rows(S, HEADS, BLOCK_R, tl.program_id(0))
    cols = tl.arange(0, BLOCK_H)
    live = r < rows
    mask = live[:, None] & (cols < HALF)[None, :]
    x1, x2 = _halves(x_ptr, _offsets(b, pos, head, sxb, sxs, sxh)[:, None] + cols[None, :], mask, HALF)
    if HAS_NORM:
        total = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(total, 2.0 * HALF) + eps))
        tl.store(rstd_ptr + r, rstd, mask=live)
        w1, w2 = _halves(w_ptr, cols[None, :], (cols < HALF)[None, :], HALF)
        x1 = x1 * rstd[:, None] * w1
        x2 = x2 * rstd[:, None] * w2
    tab = pos[:, None] * HALF + cols[None, :]
    c = tl.load(cos_ptr + tab, mask=mask, other=0.0)
    s = tl.load(sin_ptr + tab, mask=mask, other=0.0)
    y_at = r.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    tl.store(y_ptr + y_at, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_at + HALF, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_bwd_kernel(dy_ptr, x_ptr, cos_ptr, sin_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, blocks, S, HEADS,
                     sdb, sds, sdh, sxb, sxs, sxh, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Persistent program i: row blocks i, i + num_programs, ..: dx (module doc), and with a weight its fp32
    dweight partial over those rows into dw[i] (dw [num_programs, 2*HALF])."""
    cols = tl.arange(0, BLOCK_H)
    col_ok = (cols < HALF)[None, :]
    if HAS_NORM:
        w1, w2 = _halves(w_ptr, cols[None, :], col_ok, HALF)
        dw1 = tl.zeros([BLOCK_H], dtype=tl.float32)
        dw2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
        r, b, pos, head = _rows(S, HEADS, BLOCK_R, block)
        live = r < rows
        mask = live[:, None] & col_ok
        dy1, dy2 = _halves(dy_ptr, _offsets(b, pos, head, sdb, sds, sdh)[:, None] + cols[None, :], mask, HALF)
        tab = pos[:, None] * HALF + cols[None, :]
        c = tl.load(cos_ptr + tab, mask=mask, other=0.0)
        s = tl.load(sin_ptr + tab, mask=mask, other=0.0)
        g1 = dy1 * c + dy2 * s
        g2 = dy2 * c - dy1 * s
        if HAS_NORM:
            x1, x2 = _halves(x_ptr, _offsets(b, pos, head, sxb, sxs, sxh)[:, None] + cols[None, :], mask, HALF)
            rstd = tl.load(rstd_ptr + r, mask=live, other=0.0)[:, None]
            xh1 = x1 * rstd
            xh2 = x2 * rstd
            dw1 += tl.sum(g1 * xh1, axis=0)
            dw2 += tl.sum(g2 * xh2, axis=0)
            g1 = g1 * w1
            g2 = g2 * w2
            mean = tl.div_rn(tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1), 2.0 * HALF)[:, None]
            g1 = (g1 - xh1 * mean) * rstd
            g2 = (g2 - xh2 * mean) * rstd
        dx_at = r.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
        tl.store(dx_ptr + dx_at, g1.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + dx_at + HALF, g2.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_NORM:
        part = tl.program_id(0).to(tl.int64) * (2 * HALF) + cols
        tl.store(dw_ptr + part, dw1, mask=cols < HALF)
        tl.store(dw_ptr + part + HALF, dw2, mask=cols < HALF)


# ---- host ------------------------------------------------------------------------------------------------------


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, what: str) -> None:
    if x.dim() != 4 or x.shape[-1] % 2 or x.dtype not in DTYPES:
        raise ValueError(f"{what}: x {tuple(x.shape)} {x.dtype} must be [B, S, h, D] with D even, of "
                         "float32/bfloat16/float16")
    half = x.shape[-1] // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (x.shape[1], half) or t.dtype != torch.float32:
            raise ValueError(f"{what}: {name} {tuple(t.shape)} {t.dtype} must be [S, D/2] = [{x.shape[1]}, {half}] "
                             "float32")
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"{what}: weight {tuple(weight.shape)} must be [D] = [{x.shape[-1]}]")
    tensors = [x, cos, sin] + ([weight] if weight is not None else [])
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"{what}: tensors on different devices {[str(t.device) for t in tensors]}")
    if x.numel() // max(x.shape[-1], 1) > 2**30:
        raise ValueError(f"{what}: {x.numel() // x.shape[-1]} rows; at most 2^30 (row ids are 32-bit)")
    if x.device.type != "cuda":
        if not interpreting():
            raise RuntimeError(f"{what} needs CUDA tensors (got {x.device}) or TRITON_INTERPRET=1 set before "
                               "triton is imported (CPU interpreter)")
        interpreter_numpy_shim()
        interpreter_rounding_shim()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (the kernels take the other strides), else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float = 1e-6, tile: RopeTile | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y [B, S, h, D] contiguous in x's dtype, rstd fp32 [B, S, h] or None without a weight): module doc."""
    _check(x, cos, sin, weight, "rope_fwd")
    B, S, heads, D = x.shape
    x, cos, sin = _last_dim_contiguous(x), cos.contiguous(), sin.contiguous()
    y = torch.empty(B, S, heads, D, dtype=x.dtype, device=x.device)
    rstd = torch.empty(B, S, heads, dtype=torch.float32, device=x.device) if weight is not None else None
    rows = B * S * heads
    if rows == 0 or D == 0:
        return y, rstd
    tile = tile or rope_tile(D)
    w = weight.contiguous() if weight is not None else cos
    with cuda_device.on_device(x.device):
        launch(_rope_fwd_kernel, (cdiv(rows, tile.rows),), x, cos, sin, w, y, rstd if rstd is not None else cos,
               rows, S, heads, x.stride(0), x.stride(1), x.stride(2), float(eps), HALF=D // 2,
               HAS_NORM=weight is not None, BLOCK_R=tile.rows, BLOCK_H=next_pow2(D // 2), num_warps=tile.warps,
               enable_fp_fusion=False)
    return y, rstd


def _programs(blocks: int, device: torch.device, tile: RopeTile) -> int:
    if device.type == "cuda":
        return max(1, min(blocks, cuda_device.sm_count(device) * tile.programs_per_sm))
    return max(1, min(blocks, tile.cpu_programs))


def rope_bwd(dy: torch.Tensor, x: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             weight: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
             tile: RopeTile | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx [B, S, h, D] contiguous in dy's dtype, dweight fp32 [D] or None without a weight) from dy; with a weight
    x (the forward's input, any strides with the last dim contiguous) and rstd fp32 [B, S, h] (the forward's)."""
    _check(dy, cos, sin, weight, "rope_bwd")
    B, S, heads, D = dy.shape
    if weight is not None and (x is None or rstd is None or x.shape != dy.shape or x.device != dy.device
                               or rstd.shape != (B, S, heads) or rstd.dtype != torch.float32):
        raise ValueError(f"rope_bwd: with a weight, x must be {tuple(dy.shape)} and rstd [B, S, h] = "
                         f"[{B}, {S}, {heads}] float32, on {dy.device}")
    dy, cos, sin = _last_dim_contiguous(dy), cos.contiguous(), sin.contiguous()
    dx = torch.empty(B, S, heads, D, dtype=dy.dtype, device=dy.device)
    rows = B * S * heads
    tile = tile or rope_tile(D)
    blocks = cdiv(rows, tile.rows)
    if weight is None:
        programs, dw, x_arg, rstd_arg, w_arg, x_strides = blocks, None, dy, cos, cos, (0, 0, 0)
    else:
        programs = _programs(blocks, dy.device, tile)
        dw = torch.empty(programs, D, dtype=torch.float32, device=dy.device)
        x_arg, rstd_arg, w_arg = _last_dim_contiguous(x), rstd.contiguous(), weight.contiguous()
        x_strides = (x_arg.stride(0), x_arg.stride(1), x_arg.stride(2))
    if rows == 0 or D == 0:
        return dx, None if weight is None else torch.zeros(D, dtype=torch.float32, device=dy.device)
    with cuda_device.on_device(dy.device):
        launch(_rope_bwd_kernel, (programs,), dy, x_arg, cos, sin, w_arg, rstd_arg, dx, dw if dw is not None else cos,
               rows, blocks, S, heads, dy.stride(0), dy.stride(1), dy.stride(2), *x_strides, HALF=D // 2,
               HAS_NORM=weight is not None, BLOCK_R=tile.rows, BLOCK_H=next_pow2(D // 2), num_warps=tile.warps,
               enable_fp_fusion=False)
    return dx, None if dw is None else dw.sum(dim=0)
