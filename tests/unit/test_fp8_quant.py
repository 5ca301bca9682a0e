"""FP8 quantization recipes and the FP8 grouped-GEMM references: tile scales, partial and zero tiles, MX powers of
two, and SNR against fp32 on normal and heavy-tailed inputs, uneven and empty groups included."""

import math

import pytest
import torch

from moetrain.ops.fp8_quant import E4M3_MAX, RECIPES, quantize, quantize_tiles, round_trip, snr_db, tile_of
from moetrain.ops.grouped_gemm_fp8 import (
    grouped_dgrad_fp8_reference,
    grouped_gemm_fp8_reference,
    grouped_wgrad_fp8_reference,
)

MIN_SNR_DB = 25.0


def _normal(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _heavy_tailed(*shape, seed=0):
    """Student-t with 3 degrees of freedom, plus a few 100x outliers: activations with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = _student_t(shape, g)
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (max(flat.numel() // 2000, 1),), generator=g)
    flat[idx] *= 100.0
    return x


def _student_t(shape, g, dof=3.0):
    z = torch.randn(*shape, generator=g)
    chi2 = sum(torch.randn(*shape, generator=g) ** 2 for _ in range(int(dof)))
    return z / torch.sqrt(chi2 / dof)


def test_tiles_per_recipe_and_role():
    assert tile_of("tensorwise", "activation", (300, 200)) == (300, 200)
    assert tile_of("rowwise", "weight", (4, 300, 200)) == (1, 200)
    assert tile_of("blockwise", "activation", (300, 200)) == (1, 128)
    assert tile_of("blockwise", "weight", (4, 300, 200)) == (128, 128)
    assert tile_of("mxfp8", "weight", (300, 200)) == (1, 32)
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp4'"):
        tile_of("fp4", "activation", (2, 2))


def test_each_tile_amax_lands_on_448_and_partial_tiles_use_their_own_values():
    x = _normal(3, 200) * torch.tensor([1.0, 10.0, 0.01])[:, None]
    q = quantize(x, "blockwise")
    assert q.scale.shape == (3, 2)  # 200 = 128 + a partial tile of 72
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == x.shape
    amax = torch.stack([x[:, :128].abs().amax(1), x[:, 128:].abs().amax(1)], 1)
    torch.testing.assert_close(q.scale, amax / E4M3_MAX)
    assert q.data.float().abs().amax() == E4M3_MAX


def test_zero_tiles_keep_scale_one_and_dequantize_to_zero():
    x = torch.zeros(2, 256)
    x[1, 128:] = _normal(128)
    q = quantize(x, "blockwise")
    assert q.scale[0].tolist() == [1.0, 1.0] and q.scale[1, 0] == 1.0
    out = q.dequantize()
    assert torch.all(out[0] == 0) and torch.all(out[1, :128] == 0)


def test_mx_scales_are_powers_of_two_and_nothing_saturates():
    x = _normal(64, 96, seed=3) * 37.0
    q = quantize(x, "mxfp8")
    exponents = torch.log2(q.scale)
    assert torch.equal(exponents, exponents.round())
    assert q.data.float().abs().amax() <= E4M3_MAX
    assert snr_db(x, q.dequantize()) > MIN_SNR_DB


def test_mx_scales_round_up_just_above_a_power_of_two_and_stay_on_one():
    # amax / 448 one ulp above 2^k: the scale is 2^(k+1) (fp32 log2 would round it to k and saturate the amax)
    k = torch.tensor([-20.0, -7.0, -3.0, 0.0, 3.0, 20.0])
    just_above = torch.nextafter(torch.exp2(k), torch.tensor(math.inf))
    x = torch.zeros(6, 64)
    x[:, 0] = just_above * E4M3_MAX
    x[:, 32] = torch.exp2(k) * E4M3_MAX  # exactly 448 * 2^k: scale 2^k, the amax on 448
    q = quantize(x, "mxfp8")
    assert torch.equal(q.scale[:, 0], torch.exp2(k + 1)) and torch.equal(q.scale[:, 1], torch.exp2(k))
    assert torch.equal(q.data[:, 32].float(), torch.full((6,), E4M3_MAX))
    assert torch.all(q.data[:, 0].float() < E4M3_MAX)
    assert torch.equal(quantize(torch.zeros(2, 40), "mxfp8").scale, torch.ones(2, 2))


def test_weight_blocks_cover_128_by_128_and_batch_over_experts():
    w = _normal(3, 256, 384, seed=4)
    w[1, :128, 128:256] *= 50.0
    q = quantize(w, "blockwise", "weight")
    assert q.scale.shape == (3, 2, 3)
    assert q.scale[1, 0, 1] == pytest.approx(w[1, :128, 128:256].abs().max().item() / E4M3_MAX)
    # square blocks: quantizing the transpose gives the same values, transposed
    torch.testing.assert_close(round_trip(w.transpose(1, 2), "blockwise", "weight"),
                               round_trip(w, "blockwise", "weight").transpose(1, 2))


@pytest.mark.parametrize("recipe", RECIPES)
def test_round_trip_snr_on_normal_inputs(recipe):
    x = _normal(256, 512, seed=5)
    assert snr_db(x, round_trip(x, recipe)) > MIN_SNR_DB


def test_fine_tiles_keep_heavy_tailed_inputs_where_a_tensorwise_scale_loses_them():
    x = _heavy_tailed(256, 512, seed=6)
    snr = {r: snr_db(x, round_trip(x, r)) for r in RECIPES}
    assert snr["blockwise"] > MIN_SNR_DB and snr["mxfp8"] > MIN_SNR_DB
    assert snr["blockwise"] >= snr["rowwise"] - 0.5 and snr["rowwise"] >= snr["tensorwise"] - 0.5


def test_quantize_rejects_vectors():
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_tiles(torch.ones(4), (1, 4))


def test_snr_of_an_exact_copy_is_infinite():
    x = _normal(4, 4)
    assert snr_db(x, x.clone()) == math.inf


# ---- grouped GEMM references ----------------------------------------------------------------------------------

def _groups(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("inputs", ["normal", "heavy_tailed"])
def test_grouped_references_track_fp32_uneven_and_empty_groups(recipe, inputs):
    make = _normal if inputs == "normal" else _heavy_tailed
    sizes = [70, 0, 200, 1, 129]  # uneven, an empty group, a one-row group, a partial 128-row tile
    G, N, K, M = len(sizes), 160, 192, sum(sizes) + 5  # 5 trailing rows of no group
    offs = _groups(sizes)
    x, w, dy = make(M, K, seed=7), make(G, N, K, seed=8) * 0.05, make(M, N, seed=9)
    y = grouped_gemm_fp8_reference(x, w, offs, recipe)
    dx = grouped_dgrad_fp8_reference(dy, w, offs, recipe)
    dw = grouped_wgrad_fp8_reference(dy, x, offs, recipe)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    y_ref, dx_ref, dw_ref = torch.zeros(M, N), torch.zeros(M, K), torch.zeros(G, N, K)
    for g, (s, e) in enumerate(zip(starts, ends)):
        y_ref[s:e] = x[s:e] @ w[g].T
        dx_ref[s:e] = dy[s:e] @ w[g]
        dw_ref[g] = dy[s:e].T @ x[s:e]
    assert torch.all(y[ends[-1]:] == 0) and torch.all(dx[ends[-1]:] == 0) and torch.all(dw[1] == 0)
    for name, got, want in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert snr_db(want, got) > MIN_SNR_DB, f"{recipe} {name}: {snr_db(want, got):.1f} dB"
