"""MXFP8 grouped GEMM (E4M3 data, power-of-two E8M0 scales per 1 x 32 along each GEMM's reduction): our Triton
quantizer and GEMMs (``kernels.fp8_mx``) for forward, data gradient and weight gradient, with autograd. References:
``ops.grouped_gemm_fp8`` (fp32 math on the same quantized values); the recipe: ``ops.fp8_quant``.

Shapes and dtypes (legend in ``ops.fp8_quant``): x [M, K], w [G, N, K] float; offs [G] int32 group ends; y [M, N]
in x's dtype (rows past offs[-1] are 0). K and N must be multiples of 32: the forward reduces over K, the data
gradient over N, in whole scale tiles.

    GEMM      A (scaled along the reduction)          B (scaled along the reduction)              kernel
    forward   x [M, K] along K                        w [G, N, K] along K (cached)                 grouped_gemm_mx
    dgrad     dy [M, N] along N                       w^T [G, K, N] along N (cached, a 2nd copy)   grouped_gemm_mx
    wgrad     dy^T [N, M] along M                     x^T [K, M] along M (made in the forward)     grouped_wgrad_mx
The forward and the data gradient run one kernel (groups along the output's rows); the weight gradient's groups lie
along its reduction, so it has its own kernel with the same inner step. Costs beyond the GEMMs: the weights'
second (transposed) FP8 copy, once per optimizer step (``WEIGHTS``: 1 byte + 1/32 per weight element, held with the
weight); the transposed operands x^T and dy^T are quantized by reading x and dy in place along their columns (no
transposed bf16 copy; strided reads, each 32-row tile of a column contiguous); x^T's FP8 copy is kept from the
forward for the backward (half of x's bf16 bytes, instead of x).

The compiled kernels use tl.dot_scaled (Blackwell's block-scaled tensor cores; Hopper: Triton's emulation, correct,
not fast); on CPU tensors (Triton's interpreter) the tiles are dequantized in the kernel instead.
"""

from __future__ import annotations

import torch

MX = 32


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [G, N, K] -> (q [G, N, K], s [G, N, K / 32]) along K for the forward and (qt [G, K, N], st [G, K, N / 32])
    along N for the data gradient: fp8 data, uint8 E8M0 scales. Each from one read of w."""
    from moetrain.kernels.fp8_mx import quantize_mx

    q, s = quantize_mx(w)
    qt, st = quantize_mx(w.transpose(1, 2))
    return q, s, qt, st


def _cpu_tiles(x: torch.Tensor) -> dict:
    """Smaller tiles in the interpreter (CPU tensors), where the GEMMs are small (tests, the tiny model)."""
    return {} if x.is_cuda else dict(block_m=32, block_n=64, block_k=64)


class _MXGroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs):
        from moetrain.kernels.fp8_mx import grouped_gemm_mx, quantize_mx
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        xq, sx = quantize_mx(x)
        wq, sw, _, _ = WEIGHTS.get(w, "mxfp8")
        y = grouped_gemm_mx(xq, sx, wq, sw, offs, out_dtype=x.dtype, **_cpu_tiles(x))
        xt, sxt = quantize_mx(x.t())  # x^T [K, M] along M: the weight gradient's operand
        ctx.save_for_backward(xt, sxt, offs)
        ctx.w, ctx.x_dtype = w, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        from moetrain.kernels.fp8_mx import grouped_gemm_mx, grouped_wgrad_mx, quantize_mx
        from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

        xt, sxt, offs = ctx.saved_tensors
        w = ctx.w
        dyq, sdy = quantize_mx(dy)
        _, _, wqt, swt = WEIGHTS.get(w, "mxfp8")
        dx = grouped_gemm_mx(dyq, sdy, wqt, swt, offs, out_dtype=ctx.x_dtype, **_cpu_tiles(dy))
        dyt, sdyt = quantize_mx(dy.t())  # dy^T [N, M] along M
        tiles = {} if dy.is_cuda else dict(block_n=32, block_k=64, block_r=64)
        dw = grouped_wgrad_mx(dyt, sdyt, xt, sxt, offs, out_dtype=w.dtype, **tiles)
        return dx, dw, None


def grouped_gemm_fp8_mx(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y [M, N] = x_g @ w_g^T in MXFP8 (the module doc), with autograd."""
    N, K = w.shape[1], w.shape[2]
    if N % MX or K % MX:
        raise ValueError(f"grouped_gemm_fp8_mx: N {N} and K {K} (w {tuple(w.shape)}) must be multiples of 32 (the "
                         "MX scale tiles along each GEMM's reduction)")
    return _MXGroupedGemm.apply(x, w, offs)
