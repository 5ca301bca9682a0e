"""The FP8 grouped-GEMM op (``ops.grouped_gemm_fp8``, kernels included: Triton's interpreter on the CPU) against
fp32 math on the unquantized tensors: the SNR of y, dx and dw is >= 25 dB for every built recipe on normal and on
heavy-tailed inputs, uneven and empty groups included; no more than 1 dB below the recipe's own round trip (the
references: fp32 math on the recipe's quantized operands), so the kernels lose nothing beyond the quantization; and
no more than 1 dB below a plain round trip (one E4M3 scale per tensor), so finer scales cost nothing against it.
mxfp8 is exempt from the last: its power-of-two scales map no tile's amax onto 448 exactly, which costs 0.8 dB per
operand against the plain round trip on heavy-tailed inputs (their SNR is dominated by the outliers, which amax
scaling represents exactly): dw 28.7 dB against 30.1."""

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.config.schema import FP8_BUILT  # noqa: E402
from moetrain.ops.fp8_quant import quantize_tiles, snr_db  # noqa: E402
from moetrain.ops.grouped_gemm_fp8 import (  # noqa: E402
    grouped_dgrad_fp8_reference,
    grouped_gemm_fp8,
    grouped_gemm_fp8_reference,
    grouped_wgrad_fp8_reference,
)

DEVICE = "cuda" if ON_GPU else "cpu"
RECIPES = [r for r in FP8_BUILT if r != "none"]
SIZES = [70, 0, 130, 1, 60]  # uneven, an empty group, one row, a group over a 128-row tile; 7 rows of no group
MIN_SNR_DB, PLAIN_MARGIN_DB = 25.0, 1.0


def _normal(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _heavy_tailed(*shape, seed):
    """Student-t (3 degrees of freedom) with a few 100x outliers: activations with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=g)
    chi2 = sum(torch.randn(*shape, generator=g) ** 2 for _ in range(3))
    x = z / torch.sqrt(chi2 / 3)
    flat = x.view(-1)
    flat[torch.randint(0, flat.numel(), (max(flat.numel() // 2000, 1),), generator=g)] *= 100.0
    return x


def _plain(t):
    """t through E4M3 with one scale for the whole tensor, back in fp32."""
    return quantize_tiles(t, tuple(t.shape[-2:])).dequantize()


def _grouped(x, w, dy, offs):
    """fp32 y [M, N], dx [M, K], dw [G, N, K] of y_g = x_g @ w_g^T (rows of no group: 0)."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    y, dx = torch.zeros(x.shape[0], w.shape[1]), torch.zeros_like(x)
    dw = torch.zeros_like(w)
    for g, (s, e) in enumerate(zip(starts, ends)):
        y[s:e], dx[s:e], dw[g] = x[s:e] @ w[g].T, dy[s:e] @ w[g], dy[s:e].T @ x[s:e]
    return y, dx, dw


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("inputs", ["normal", "heavy_tailed"])
def test_op_snr_against_fp32_is_at_least_25_db_and_within_1_db_of_a_plain_round_trip(recipe, inputs):
    make = _normal if inputs == "normal" else _heavy_tailed
    G, N, K, M = len(SIZES), 160, 192, sum(SIZES) + 7
    offs = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    x, w, dy = make(M, K, seed=1), make(G, N, K, seed=2) * 0.05, make(M, N, seed=3)
    exact = _grouped(x, w, dy, offs)
    plain = _grouped(_plain(x), _plain(w), _plain(dy), offs)
    own = (grouped_gemm_fp8_reference(x, w, offs, recipe), grouped_dgrad_fp8_reference(dy, w, offs, recipe),
           grouped_wgrad_fp8_reference(dy, x, offs, recipe))

    xg = x.to(DEVICE).requires_grad_(True)
    wg = w.to(DEVICE).requires_grad_(True)
    y = grouped_gemm_fp8(xg, wg, offs.to(DEVICE), recipe=recipe)
    y.backward(dy.to(DEVICE))
    got = (y.detach().float().cpu(), xg.grad.float().cpu(), wg.grad.float().cpu())
    for name, want, ours, floor, quantized in zip(("y", "dx", "dw"), exact, got, plain, own):
        snr, plain_snr, own_snr = snr_db(want, ours), snr_db(want, floor), snr_db(want, quantized)
        assert snr >= MIN_SNR_DB, f"{recipe} {inputs} {name}: {snr:.1f} dB"
        assert snr >= own_snr - PLAIN_MARGIN_DB, f"{recipe} {inputs} {name}: {snr:.1f} dB, its own {own_snr:.1f}"
        if recipe != "mxfp8":
            assert snr >= plain_snr - PLAIN_MARGIN_DB, f"{recipe} {inputs} {name}: {snr:.1f} dB, plain {plain_snr:.1f}"
