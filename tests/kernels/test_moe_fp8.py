"""The fused FP8 expert path (``ops.moe_experts_fp8``: token rows quantized into their permuted rows, the weight
gradients' columns read through each row's token) against the unfused composition of the same recipe (rows
permuted in 16 bits, then ``grouped_gemm_fp8``): the same quantized values, so the same outputs and gradients up to
the combine's summation order. Kernel level: the scattering row quantizer and the gathering column quantizer write
the bits their unpermuted counterparts write for the permuted rows. CPU: Triton's interpreter, GEMMs emulated."""

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from kernel_checks import rel_err  # noqa: E402
from moetrain.kernels.fp8_rowwise import quantize_group_cols, quantize_rows  # noqa: E402
from moetrain.ops.dispatch import combine_rows, permute_tokens  # noqa: E402
from moetrain.ops.grouped_gemm_fp8 import grouped_gemm_fp8  # noqa: E402
from moetrain.ops.moe import sort_rows_kernel  # noqa: E402
from moetrain.ops.moe_fp8 import moe_experts_fp8  # noqa: E402
from moetrain.ops.moe_rows import swiglu  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def _routing(T, E, K, seed, dropped=()):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[:, 0] = torch.where(torch.rand(T, generator=g) < 0.5, 1, idx[:, 0])  # skew: one expert hot
    idx = torch.where((idx == 1).cumsum(1) > 1, (idx + 2) % E, idx)  # keep a token's experts distinct
    for t, k in dropped:
        idx[t, k] = -1
    return idx.to(DEVICE), torch.rand(T, K, generator=g).to(DEVICE)


def _same_bits(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def test_scattered_rows_and_gathered_columns_are_the_permuted_rows_quantized():
    T, C, E, K = 37, 80, 5, 2
    x = (torch.randn(T, C, generator=torch.Generator().manual_seed(0)) * 3).to(DEVICE)
    idx, _ = _routing(T, E, K, seed=1)
    offs, _row_map, inverse, token_of_row = sort_rows_kernel(idx, None, E)
    rows = x.index_select(0, token_of_row.long())
    q, s = quantize_rows(x, scatter=inverse, topk=K)
    q_want, s_want = quantize_rows(rows)
    assert _same_bits(q, q_want) and torch.equal(s, s_want)
    qt, st, ends = quantize_group_cols(x, offs, gather=token_of_row)
    qt_want, st_want, ends_want = quantize_group_cols(rows, offs)
    assert torch.equal(ends, ends_want) and torch.equal(st, st_want)
    last = int(ends[-1])
    assert _same_bits(qt[:, :last], qt_want[:, :last])


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_both_ways_of_quantizing_token_rows_write_the_same_bits(recipe):
    from moetrain.ops.moe_fp8 import TOKEN_ROWS_VARIANTS, _quantize_token_rows

    T, C, E, K = 29, 48, 4, 3
    x = torch.randn(T, C, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    idx, _ = _routing(T, E, K, seed=6)
    offs, _row_map, inverse, token_of_row = sort_rows_kernel(idx, None, E)
    scatter, copy = (_quantize_token_rows(v, x, offs, token_of_row, inverse, K, recipe) for v in TOKEN_ROWS_VARIANTS)
    q, s, qt, st, ends = scatter
    last = int(ends[-1])
    assert _same_bits(q, copy[0]) and torch.equal(s, copy[1]) and torch.equal(st, copy[3])
    assert torch.equal(ends, copy[4]) and _same_bits(qt[:, :last], copy[2][:, :last])


def _unfused(x, idx, weight, w1, w2, recipe):
    p = permute_tokens(x, idx, weight, w1.shape[0], "triton")
    h = grouped_gemm_fp8(p.rows, w1, p.offs, recipe=recipe)
    y = grouped_gemm_fp8(swiglu(h, "swiglu", "triton", probs=p.probs), w2, p.offs, recipe=recipe)
    return combine_rows(y, p.inverse, idx.shape[1], None, "triton")


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_fused_fp8_path_equals_the_unfused_composition(recipe):
    T, H, I, E, K = 48, 64, 32, 6, 2
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).to(DEVICE, DTYPE)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, DTYPE)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, DTYPE)
    idx, weight = _routing(T, E, K, seed=3, dropped=[(0, 1), (5, 0)])
    dout = torch.randn(T, H, generator=g).to(DEVICE, DTYPE)
    results = []
    for run in (moe_experts_fp8, None):
        leaves = [t.clone().requires_grad_(True) for t in (x, weight, w1, w2)]
        xl, wl, w1l, w2l = leaves
        if run is None:
            out = _unfused(xl, idx, wl, w1l, w2l, recipe)
        else:
            out = run(xl, idx, wl, w1l, w2l, recipe=recipe)
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("out", "dx", "dweight", "dw1", "dw2"), *results):
        assert got.shape == want.shape and torch.isfinite(got).all(), name
        assert rel_err(got, want) < 1e-5, f"{recipe} {name}: {rel_err(got, want):.2e}"
    assert results[0][2][0, 1] == 0 and results[0][2][5, 0] == 0  # dropped assignments get no gradient
