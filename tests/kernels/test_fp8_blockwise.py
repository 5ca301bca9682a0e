"""Blockwise FP8 Triton kernels against their references (``ops.fp8_quant``, ``ops.grouped_gemm_fp8``): the 1 x 128
quantizers bit for bit (rows; rows and transposed columns in one pass; weight blocks and their transpose), the
grouped GEMM to fp32 rounding on the same quantized operands (forward, and the data
gradient through the transposed weight blocks), uneven, empty and one-row groups, partial K and N tiles, rows of no
group. On the CPU the kernels run in Triton's interpreter."""

import pytest
import torch

from kernel_checks import FP8_SIZES as SIZES, fp8_group_offs, fp8_grouped_data, rel_err
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels.fp8_blockwise import grouped_gemm_blockwise, grouped_wgrad_blockwise  # noqa: E402
from moetrain.kernels.fp8_quantize import (  # noqa: E402
    quantize_rows_1x128,
    quantize_rows_and_cols,
    quantize_weight_blocks,
)
from moetrain.ops.fp8_quant import quantize, quantize_tiles  # noqa: E402
from moetrain.ops.grouped_gemm_fp8 import (  # noqa: E402
    grouped_dgrad_fp8_reference,
    grouped_gemm_fp8_reference,
    grouped_wgrad_fp8_reference,
)

DEVICE = "cuda" if ON_GPU else "cpu"
# fp32 accumulation of exact FP8 products in another order; on Hopper, tiles of 64 rows or more run on wgmma, whose
# FP8 products accumulate with fewer mantissa bits within each 128-wide K slice (the kernels promote per slice)
BOUND = 5e-4 if ON_GPU else 1e-5


def _same_bits(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def test_row_quantizer_matches_the_reference_bit_for_bit():
    x, _ = fp8_grouped_data(DEVICE, 37, 1, 200)
    x = x.to(torch.bfloat16)
    q, s = quantize_rows_1x128(x)
    ref = quantize(x, "blockwise", "activation")
    assert torch.equal(s.cpu(), ref.scale.cpu()) and _same_bits(q, ref.data)


def test_rows_and_cols_quantizer_writes_both_copies_in_one_pass():
    x, _ = fp8_grouped_data(DEVICE, 300, 1, 200, seed=4)  # partial tiles both ways
    q, s, qt, st = quantize_rows_and_cols(x.to(torch.bfloat16))
    rows = quantize(x.to(torch.bfloat16), "blockwise", "activation")
    cols = quantize_tiles(x.to(torch.bfloat16).T.contiguous(), (1, 128))  # x^T along M, 128 rows of x a tile
    assert torch.equal(s.cpu(), rows.scale.cpu()) and _same_bits(q, rows.data)
    assert qt.shape == (200, 300) and st.shape == (200, 3)
    assert torch.equal(st.cpu(), cols.scale.cpu()) and _same_bits(qt, cols.data)


@pytest.mark.parametrize("G,N,K", [(4, 300, 200), (5, 160, 200), (3, 256, 384)])
def test_weight_block_quantizer_writes_the_blocks_and_their_transpose(G, N, K):
    w = (torch.randn(G, N, K, generator=torch.Generator().manual_seed(5)) * 0.05).to(DEVICE)
    q, qt, s = quantize_weight_blocks(w)
    ref = quantize(w, "blockwise", "weight")
    assert torch.equal(s.cpu(), ref.scale.cpu()) and _same_bits(q, ref.data)
    assert _same_bits(qt, ref.data.transpose(1, 2).contiguous())


@pytest.mark.parametrize("block_n,pair,group_m", [(64, False, 2), (128, True, 1), (32, True, 4)])
def test_forward_matches_fp32_math_on_the_quantized_values(block_n, pair, group_m):
    M, N, K = sum(SIZES) + 6, 160, 200
    x, w = fp8_grouped_data(DEVICE, M, N, K, seed=1)
    offs = fp8_group_offs(DEVICE)
    xq, wq = quantize(x, "blockwise"), quantize(w, "blockwise", "weight")
    y = grouped_gemm_blockwise(xq.data, xq.scale, wq.data, wq.scale, offs, out_dtype=torch.float32, block_m=32,
                               block_n=block_n, num_warps=4, num_stages=2, group_m=group_m, pair=pair)
    ref = grouped_gemm_fp8_reference(x, w, offs, "blockwise")
    assert torch.all(y[sum(SIZES):] == 0)
    assert rel_err(y, ref) < BOUND


def test_data_gradient_runs_on_the_transposed_weight_blocks():
    M, N, K = sum(SIZES) + 6, 300, 160  # 3 slices of 128 along the reduction over N: an odd count for pair
    x, w = fp8_grouped_data(DEVICE, M, N, K, seed=2)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    offs = fp8_group_offs(DEVICE)
    gq, wq = quantize(dy, "blockwise"), quantize(w, "blockwise", "weight")  # dy along N
    wt = wq.data.transpose(1, 2).contiguous()  # [G, K, N]: the same blocks, K-major for the reduction over N
    dx = grouped_gemm_blockwise(gq.data, gq.scale, wt, wq.scale.transpose(1, 2).contiguous(), offs, out_dtype=torch.float32,
                                block_m=32, block_n=64, num_warps=4, num_stages=2, pair=True)
    ref = grouped_dgrad_fp8_reference(dy, w, offs, "blockwise")
    assert rel_err(dx, ref) < BOUND


def test_weight_gradient_over_each_groups_rows_from_the_transposed_copies(poisoned_empty):
    M, N, K = sum(SIZES) + 6, 160, 200  # groups meet the 128-row tiles anywhere; 6 rows of no group
    x, _ = fp8_grouped_data(DEVICE, M, N, K, seed=6)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    offs = fp8_group_offs(DEVICE)
    _, _, dyt, sdyt = quantize_rows_and_cols(dy)
    _, _, xt, sxt = quantize_rows_and_cols(x)
    dw = grouped_wgrad_blockwise(dyt, sdyt, xt, sxt, offs, block_n=32, block_k=64, num_warps=4, num_stages=2)
    ref = grouped_wgrad_fp8_reference(dy, x, offs, "blockwise")
    assert torch.all(dw[1] == 0)  # the empty group
    assert rel_err(dw, ref) < BOUND


def test_autograd_op_matches_the_references_and_requantizes_a_changed_weight():
    from moetrain.ops.grouped_gemm_fp8 import WEIGHTS, grouped_gemm_fp8

    M, N, K = sum(SIZES) + 6, 160, 200
    x, w = fp8_grouped_data(DEVICE, M, N, K, seed=8)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    offs = fp8_group_offs(DEVICE)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = grouped_gemm_fp8(xg, wg, offs)
    y.backward(dy)
    assert rel_err(y, grouped_gemm_fp8_reference(x, w, offs, "blockwise")) < BOUND
    assert rel_err(xg.grad, grouped_dgrad_fp8_reference(dy, w, offs, "blockwise")) < BOUND
    assert rel_err(wg.grad, grouped_wgrad_fp8_reference(dy, x, offs, "blockwise")) < BOUND
    first = WEIGHTS.get(wg)
    assert WEIGHTS.get(wg) is first  # the same step: cached
    with torch.no_grad():
        wg.mul_(2.0)  # what an optimizer step does: in place
    assert WEIGHTS.get(wg) is not first
    torch.testing.assert_close(WEIGHTS.get(wg)[2], first[2] * 2.0)
