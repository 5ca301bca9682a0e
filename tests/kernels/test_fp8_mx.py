"""MXFP8 Triton kernels against their references (``ops.fp8_quant``, ``ops.grouped_gemm_fp8``): the 1 x 32 quantizer
bit for bit (E8M0 exponents and E4M3 data; rows, a transposed view, batched weights; zero, tiny and just-above-a-power-
of-two tiles, a partial last tile), the grouped GEMMs to fp32 rounding on the same quantized operands (forward, data
gradient through the transposed weight copy, weight gradient over tiles that meet two groups), uneven, empty and
one-row groups, rows of no group, the op with autograd. On the CPU the kernels run in Triton's interpreter with the
in-kernel dequantization (it has no dot_scaled); on a GPU with tl.dot_scaled (Hopper: Triton's emulation)."""

import pytest
import torch

from kernel_checks import FP8_SIZES as SIZES, fp8_group_offs, fp8_grouped_data, rel_err
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels.fp8_mx import (  # noqa: E402
    e8m0_to_fp32,
    grouped_gemm_mx,
    grouped_wgrad_mx,
    quantize_mx,
)
from moetrain.ops.fp8_quant import E4M3_MAX, quantize  # noqa: E402
from moetrain.ops.grouped_gemm_fp8 import (  # noqa: E402
    grouped_dgrad_fp8_reference,
    grouped_gemm_fp8_reference,
    grouped_wgrad_fp8_reference,
)

DEVICE = "cuda" if ON_GPU else "cpu"
# fp32 accumulation of exact products in another order (Hopper's dot_scaled emulation: bf16 wgmma, exact products)
BOUND = 1e-4 if ON_GPU else 1e-5
SMALL = dict(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=2)  # the interpreter's cost grows with tiles


def _matches_reference(q, s, x):
    ref = quantize(x.cpu(), "mxfp8")
    assert s.dtype == torch.uint8 and q.dtype == torch.float8_e4m3fn and s.shape == ref.scale.shape
    assert torch.equal(e8m0_to_fp32(s.cpu()), ref.scale)
    assert torch.equal(q.cpu().view(torch.uint8), ref.data.view(torch.uint8))


def test_quantizer_matches_the_reference_bit_for_bit_on_edge_tiles(poisoned_empty):
    x, _ = fp8_grouped_data(DEVICE, 37, 1, 200)  # 200 columns: a last tile of 8
    x[5, :32] = 0.0  # all-zero tile: scale 1 (E8M0 127)
    x[6, 40] = E4M3_MAX * 2.0 ** -5 * (1 + 2.0 ** -10)  # amax / 448 just above 2^-5: scale 2^-4
    x[7, 64:96] = 1e-37  # amax / 448 below 2^-127: E8M0's smallest scale
    for t in (x, x.to(torch.bfloat16)):
        q, s = quantize_mx(t)
        _matches_reference(q, s, t)
    q, s = quantize_mx(x)
    assert s[5, 0] == 127 and s[6, 1] == 127 - 4 and s[7, 2] == 0


def test_quantizer_reads_transposed_and_batched_views_in_place():
    x, w = fp8_grouped_data(DEVICE, 70, 96, 64, seed=1)
    q, s = quantize_mx(x.t())  # x^T [64, 70] along the rows of x: 3 tiles, the last of 6
    _matches_reference(q, s, x.t())
    q, s = quantize_mx(w.transpose(1, 2))  # [G, K, N] along N
    _matches_reference(q, s, w.transpose(1, 2))



def test_forward_matches_fp32_math_on_the_quantized_values():
    M, N, K = sum(SIZES) + 6, 96, 160  # K: two 64-wide steps and a half one
    x, w = fp8_grouped_data(DEVICE, M, N, K, seed=2)
    offs = fp8_group_offs(DEVICE)
    (xq, sx), (wq, sw) = quantize_mx(x), quantize_mx(w)
    y = grouped_gemm_mx(xq, sx, wq, sw, offs, out_dtype=torch.float32, group_m=2, **SMALL)
    assert torch.all(y[sum(SIZES):] == 0)
    assert rel_err(y, grouped_gemm_fp8_reference(x, w, offs, "mxfp8")) < BOUND


def test_data_gradient_runs_on_the_transposed_weight_copy():
    M, N, K = sum(SIZES) + 6, 96, 128  # the reduction over N: one 64-wide step and a half one
    x, w = fp8_grouped_data(DEVICE, M, N, K, seed=3)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    offs = fp8_group_offs(DEVICE)
    (gq, sg), (wt, swt) = quantize_mx(dy), quantize_mx(w.transpose(1, 2))
    dx = grouped_gemm_mx(gq, sg, wt, swt, offs, out_dtype=torch.float32, **SMALL)
    assert rel_err(dx, grouped_dgrad_fp8_reference(dy, w, offs, "mxfp8")) < BOUND


def test_weight_gradient_over_each_groups_rows_of_tiles_shared_by_groups(poisoned_empty):
    M, N, K = sum(SIZES) + 6, 96, 64  # group starts 70, 120, 121 fall inside 32-row tiles
    x, _ = fp8_grouped_data(DEVICE, M, N, K, seed=5)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    offs = fp8_group_offs(DEVICE)
    (dyt, sdyt), (xt, sxt) = quantize_mx(dy.t()), quantize_mx(x.t())
    dw = grouped_wgrad_mx(dyt, sdyt, xt, sxt, offs, block_n=32, block_k=64, block_r=64, num_warps=4, num_stages=2)
    assert torch.all(dw[1] == 0)  # the empty group
    assert rel_err(dw, grouped_wgrad_fp8_reference(dy, x, offs, "mxfp8")) < BOUND


def test_a_reduction_that_is_not_a_multiple_of_32_is_refused_by_size():
    from moetrain.ops.grouped_gemm_fp8 import grouped_gemm_fp8

    x, w = fp8_grouped_data(DEVICE, 8, 32, 48)
    with pytest.raises(ValueError, match=r"K = 48 .* must be a multiple of 32"):
        grouped_gemm_mx(x.to(torch.float8_e4m3fn), torch.zeros(8, 1, dtype=torch.uint8, device=DEVICE),
                        w.to(torch.float8_e4m3fn), torch.zeros(5, 32, 1, dtype=torch.uint8, device=DEVICE), fp8_group_offs(DEVICE))
    with pytest.raises(ValueError, match=r"N 32 and K 48 .* must be multiples of 32"):
        grouped_gemm_fp8(x, w, torch.full((5,), 8, dtype=torch.int32, device=DEVICE), recipe="mxfp8")


def test_autograd_op_matches_the_references_and_requantizes_a_changed_weight():
    from moetrain.ops.grouped_gemm_fp8 import WEIGHTS, grouped_gemm_fp8

    M, N, K = sum(SIZES) + 6, 96, 64
    x, w = fp8_grouped_data(DEVICE, M, N, K, seed=7)
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    offs = fp8_group_offs(DEVICE)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = grouped_gemm_fp8(xg, wg, offs, recipe="mxfp8")
    y.backward(dy)
    assert rel_err(y, grouped_gemm_fp8_reference(x, w, offs, "mxfp8")) < BOUND
    assert rel_err(xg.grad, grouped_dgrad_fp8_reference(dy, w, offs, "mxfp8")) < BOUND
    assert rel_err(wg.grad, grouped_wgrad_fp8_reference(dy, x, offs, "mxfp8")) < BOUND
    first = WEIGHTS.get(wg, "mxfp8")
    assert WEIGHTS.get(wg, "mxfp8") is first  # the same step: cached
    with torch.no_grad():
        wg.mul_(2.0)  # an optimizer step: in place
    again = WEIGHTS.get(wg, "mxfp8")
    assert again is not first
    assert torch.equal(again[1].int(), first[1].int() + 1) and torch.equal(again[3].int(), first[3].int() + 1)


@pytest.mark.gpu
def test_dot_scaled_on_cuda_matches_the_references(exact_fp32):
    # default tiles (128 x 128 x 128): the configuration the op runs; bf16 inputs and outputs as in training
    from moetrain.ops.grouped_gemm_fp8 import grouped_gemm_fp8

    sizes = [700, 0, 300, 1, 523, 129]
    M, N, K = sum(sizes) + 37, 384, 288
    g = torch.Generator().manual_seed(9)
    x = torch.randn(M, K, generator=g).cuda().to(torch.bfloat16)
    w = (torch.randn(len(sizes), N, K, generator=g) * 0.05).cuda().to(torch.bfloat16)
    dy = torch.randn(M, N, generator=g).cuda().to(torch.bfloat16)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
    (xq, sx), (wq, sw) = quantize_mx(x), quantize_mx(w)
    y = grouped_gemm_mx(xq, sx, wq, sw, offs, out_dtype=torch.float32, dot_scaled=True)
    assert rel_err(y, grouped_gemm_fp8_reference(x, w, offs, "mxfp8")) < 1e-4
    (dyt, sdyt), (xt, sxt) = quantize_mx(dy.t()), quantize_mx(x.t())
    dw = grouped_wgrad_mx(dyt, sdyt, xt, sxt, offs, dot_scaled=True)
    assert rel_err(dw, grouped_wgrad_fp8_reference(dy, x, offs, "mxfp8")) < 1e-4
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = grouped_gemm_fp8(xg, wg, offs, recipe="mxfp8")
    out.backward(dy)
    assert out.dtype == torch.bfloat16 and torch.all(out[sum(sizes):] == 0)
    assert rel_err(out, grouped_gemm_fp8_reference(x, w, offs, "mxfp8")) < 1e-2  # bf16 output
    assert rel_err(xg.grad, grouped_dgrad_fp8_reference(dy, w, offs, "mxfp8")) < 1e-2
    assert rel_err(wg.grad, grouped_wgrad_fp8_reference(dy, x, offs, "mxfp8")) < 1e-2
