"""Rowwise and tensorwise FP8: the quantizers (``kernels.fp8_rowwise``) bit for bit against ``ops.fp8_quant``
(rows; each group's columns transposed and padded; a weight's per-expert transpose; given multipliers), the op
(``ops.grouped_gemm_fp8_scaled``) against the references (forward, data and weight gradients; uneven, empty and
one-row groups; rows of no group), and our arguments against torch._scaled_grouped_mm's own checks (its meta
kernel). On the CPU the kernels run in Triton's interpreter and the GEMM is emulated."""

import pytest
import torch

from kernel_checks import rel_err
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels.fp8_rowwise import (  # noqa: E402
    padded_group_ends,
    quantize_group_cols,
    quantize_rows,
    zero_rows_past,
)
from moetrain.ops.fp8_quant import quantize, scale_and_inverse  # noqa: E402
from moetrain.ops.grouped_gemm_fp8 import (  # noqa: E402
    grouped_dgrad_fp8_reference,
    grouped_gemm_fp8,
    grouped_gemm_fp8_reference,
    grouped_wgrad_fp8_reference,
)

DEVICE = "cuda" if ON_GPU else "cpu"
SIZES = [70, 0, 50, 1, 29]  # uneven, empty, one row; 6 rows of no group follow
BF16_OUT = 4e-3  # the GEMM writes bf16: one rounding of each output


def _data(M, C, seed=0):
    x = torch.randn(M, C, generator=torch.Generator().manual_seed(seed))
    x[3] *= 40.0  # one outlier row
    return x.to(DEVICE)


def _offs():
    return torch.tensor(SIZES).cumsum(0).to(torch.int32).to(DEVICE)


def _same_bits(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def test_row_quantizer_matches_the_reference_bit_for_bit():
    x = _data(37, 300).to(torch.bfloat16)  # three column chunks, the last partial
    q, s = quantize_rows(x)
    ref = quantize(x, "rowwise")
    assert torch.equal(s.cpu(), ref.scale.cpu().flatten()) and _same_bits(q, ref.data)


def test_row_quantizer_with_a_given_multiplier_is_the_tensorwise_recipe():
    x = _data(37, 300)
    scale, inverse = scale_and_inverse(x.abs().amax())
    q, s = quantize_rows(x, inverse=inverse.expand(37))
    ref = quantize(x, "tensorwise")
    assert s is None and torch.equal(scale.cpu().reshape(1, 1), ref.scale.cpu()) and _same_bits(q, ref.data)


def test_group_columns_are_each_groups_rows_transposed_and_padded():
    x = _data(sum(SIZES) + 6, 200, seed=1).to(torch.bfloat16)
    offs = _offs()
    qt, s, padded = quantize_group_cols(x, offs, align=16)
    assert padded.tolist() == [80, 80, 144, 160, 192] and qt.shape[1] % 16 == 0 and s.shape == (5, 200)
    start = out = 0
    for g, (end, out_end) in enumerate(zip(offs.tolist(), padded.tolist())):
        rows = end - start
        if rows:
            ref = quantize(x[start:end].T.contiguous(), "rowwise")
            assert torch.equal(s[g].cpu(), ref.scale.cpu().flatten()) and _same_bits(qt[:, out:out + rows], ref.data)
        else:
            assert torch.all(s[g] == 1.0)
        assert torch.all(qt[:, out + rows:out_end].float() == 0)  # the padding
        start, out = end, out_end


def test_stacked_group_columns_are_each_experts_transpose():
    w = _data(4 * 48, 64, seed=2)
    ends = (torch.arange(1, 5) * 48).to(torch.int32).to(DEVICE)
    qt, s, _ = quantize_group_cols(w, ends, stacked=True)
    ref = quantize(w.view(4, 48, 64).transpose(1, 2), "rowwise", "weight")  # [4, 64, 48], scaled along N
    assert qt.shape == (4, 64, 48) and torch.equal(s.cpu(), ref.scale.cpu().squeeze(-1))
    assert _same_bits(qt, ref.data)


def test_zero_rows_past_touches_only_the_rows_of_no_group():
    y = torch.ones(200, 40, device=DEVICE)
    zero_rows_past(y, _offs())
    assert torch.all(y[:150] == 1) and torch.all(y[150:] == 0)


def test_padded_group_ends_of_no_rows_add_nothing():
    offs = torch.tensor([0, 0, 17], dtype=torch.int32)
    assert padded_group_ends(offs, 16).tolist() == [0, 0, 32]


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_op_matches_the_references(recipe):
    from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

    M, N, K = sum(SIZES) + 6, 160, 208
    x = _data(M, K, seed=3)
    w = (torch.randn(len(SIZES), N, K, generator=torch.Generator().manual_seed(4)) * 0.05).to(DEVICE)
    dy = _data(M, N, seed=5)
    offs = _offs()
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = grouped_gemm_fp8(xg, wg, offs, recipe=recipe)
    y.backward(dy)
    assert torch.all(y[sum(SIZES):] == 0) and torch.all(xg.grad[sum(SIZES):] == 0)
    assert rel_err(y, grouped_gemm_fp8_reference(x, w, offs, recipe)) < BF16_OUT
    assert rel_err(xg.grad, grouped_dgrad_fp8_reference(dy, w, offs, recipe)) < BF16_OUT
    assert torch.all(wg.grad[1] == 0)  # the empty group
    assert rel_err(wg.grad, grouped_wgrad_fp8_reference(dy, x, offs, recipe)) < BF16_OUT
    first = WEIGHTS.get(wg, recipe)
    assert WEIGHTS.get(wg, recipe) is first  # cached within a step
    with torch.no_grad():
        wg.mul_(2.0)  # an optimizer step: in place
    assert WEIGHTS.get(wg, recipe) is not first


def test_op_refuses_dimensions_the_gemm_cannot_stride():
    x, w = torch.zeros(8, 24, device=DEVICE), torch.zeros(2, 16, 24, device=DEVICE)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_gemm_fp8(x, w, torch.tensor([4, 8], dtype=torch.int32, device=DEVICE), recipe="rowwise")


def test_our_operand_layouts_pass_torchs_scaled_grouped_mm_checks():
    """torch's meta kernel applies the CUDA kernel's argument rules (dtypes, majorness, alignment, scale shapes)."""
    from moetrain.kernels.fp8_rowwise import padded_group_ends as ends_of

    f8, meta = torch.float8_e4m3fn, "meta"
    G, M, N, K = 4, 200, 160, 208
    Mp = (M + G * 15 + 15) // 16 * 16
    offs = torch.empty(G, dtype=torch.int32, device=meta)
    x, dy = torch.empty(M, K, dtype=f8, device=meta), torch.empty(M, N, dtype=f8, device=meta)
    wq, wqt = torch.empty(G, N, K, dtype=f8, device=meta), torch.empty(G, K, N, dtype=f8, device=meta)
    xt, dyt = torch.empty(K, Mp, dtype=f8, device=meta), torch.empty(N, Mp, dtype=f8, device=meta)
    f32 = dict(device=meta, dtype=torch.float32)
    y = torch._scaled_grouped_mm(x, wq.transpose(1, 2), torch.empty(M, **f32), torch.empty(G, N, **f32), offs=offs,
                                 out_dtype=torch.bfloat16)
    dx = torch._scaled_grouped_mm(dy, wqt.transpose(1, 2), torch.empty(M, **f32), torch.empty(G, K, **f32),
                                  offs=offs, out_dtype=torch.bfloat16)
    dw = torch._scaled_grouped_mm(dyt, xt.t(), torch.empty(G * N, **f32), torch.empty(G * K, **f32), offs=offs,
                                  out_dtype=torch.bfloat16)
    assert y.shape == (M, N) and dx.shape == (M, K) and dw.shape == (G, N, K)
    assert ends_of(torch.tensor([5, 5, 40], dtype=torch.int32), 16).tolist() == [16, 16, 64]
