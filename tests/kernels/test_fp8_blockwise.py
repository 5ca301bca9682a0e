"""Blockwise FP8 Triton kernels against their references (``ops.fp8_quant``, ``ops.grouped_gemm_fp8``): the 1 x 128
quantizer bit for bit (on a GPU), the grouped GEMM to fp32 rounding on the same quantized operands (forward, and the data
gradient through the transposed weight blocks), uneven, empty and one-row groups, partial K and N tiles, rows of no
group. On the CPU the kernels run in Triton's interpreter."""

import pytest
import torch

from kernel_checks import rel_err
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels.fp8_blockwise import grouped_gemm_blockwise, quantize_rows_1x128  # noqa: E402
from moetrain.ops.fp8_quant import quantize  # noqa: E402
from moetrain.ops.grouped_gemm_fp8 import grouped_dgrad_fp8_reference, grouped_gemm_fp8_reference  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
SIZES = [70, 0, 50, 1, 29]  # uneven, empty, one row; M = 150 + 6 rows of no group
BOUND = 1e-5  # fp32 accumulation of exact FP8 products, in another order


def _data(M, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[3] *= 40.0  # one outlier row
    w = torch.randn(len(SIZES), N, K, generator=g) * 0.05
    return x.to(DEVICE), w.to(DEVICE)


def _offs():
    return torch.tensor(SIZES).cumsum(0).to(torch.int32).to(DEVICE)


@pytest.mark.skipif(not ON_GPU, reason="Triton 3.6's interpreter rounds some float32 -> e4m3 casts a binade low")
def test_row_quantizer_matches_the_reference_bit_for_bit():
    x, _ = _data(37, 1, 200)
    x = x.to(torch.bfloat16)
    q, s = quantize_rows_1x128(x)
    ref = quantize(x, "blockwise", "activation")
    assert torch.equal(s.cpu(), ref.scale.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), ref.data.cpu().view(torch.uint8))


@pytest.mark.parametrize("block_n", [64, 128])
def test_forward_matches_fp32_math_on_the_quantized_values(block_n):
    M, N, K = sum(SIZES) + 6, 160, 200
    x, w = _data(M, N, K, seed=1)
    offs = _offs()
    xq, wq = quantize(x, "blockwise"), quantize(w, "blockwise", "weight")
    y = grouped_gemm_blockwise(xq.data, xq.scale, wq.data, wq.scale, offs, out_dtype=torch.float32, block_m=32,
                               block_n=block_n, num_warps=4, num_stages=2)
    ref = grouped_gemm_fp8_reference(x, w, offs, "blockwise")
    assert torch.all(y[sum(SIZES):] == 0)
    assert rel_err(y, ref) < BOUND


def test_data_gradient_runs_on_the_transposed_weight_blocks():
    M, N, K = sum(SIZES) + 6, 256, 160
    x, w = _data(M, N, K, seed=2)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    offs = _offs()
    gq, wq = quantize(dy, "blockwise"), quantize(w, "blockwise", "weight")  # dy along N
    wt = wq.data.transpose(1, 2).contiguous()  # [G, K, N]: the same blocks, K-major for the reduction over N
    dx = grouped_gemm_blockwise(gq.data, gq.scale, wt, wq.scale.transpose(1, 2).contiguous(), offs, out_dtype=torch.float32,
                                block_m=32, block_n=64, num_warps=4, num_stages=2)
    ref = grouped_dgrad_fp8_reference(dy, w, offs, "blockwise")
    assert rel_err(dx, ref) < BOUND
