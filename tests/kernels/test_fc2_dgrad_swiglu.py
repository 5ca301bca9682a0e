"""FC2's data gradient with SwiGLU's backward in its epilogue (moetrain.kernels.fc2_dgrad_swiglu) against the
float64 references (grouped GEMM data gradient, then SwiGLU's backward with the row probabilities).

Without a GPU the kernel runs in Triton's CPU interpreter in float32; with one, the same tests run compiled in
float32, and test_fc2_dgrad_swiglu_bf16_on_gpu checks bf16 against the separate kernels. dh is poisoned with NaN.
Legend: M rows, G experts, H hidden (the reduction), I expert intermediate.
"""

import pytest
import torch

from kernel_checks import EPILOGUE_CASES, FP32_BOUND, rel_err
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels import fc2_dgrad_swiglu as fused  # noqa: E402
from moetrain.kernels import grouped_gemm as gg  # noqa: E402
from moetrain.kernels import moe_rows as rows  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"

pytestmark = pytest.mark.usefixtures("exact_fp32")  # tests/kernels/conftest.py

CONFIGS = [
    gg.GemmConfig(32, 16, 16, 1, 4, use_tma=False),
    gg.GemmConfig(32, 16, 16, 1, 4, use_tma=True),
    gg.GemmConfig(16, 16, 16, 1, 4, use_tma=True, group_m=2),
    gg.GemmConfig(32, 16, 16, 1, 4, use_tma=True, tail_split=True),
]


def inputs(offs, m, h_dim, inter, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, h_dim, generator=g)
    w2 = torch.randn(len(offs), h_dim, inter, generator=g) / inter**0.5
    h = torch.randn(m, 2 * inter, generator=g) * 3  # past the clamp limit of swiglu_clamped at times
    probs = torch.rand(m, generator=g)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    return (dy.to(DEVICE, dtype), w2.to(DEVICE, dtype), h.to(DEVICE, dtype), probs.to(DEVICE), offs_t.to(DEVICE))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("name,offs,m", EPILOGUE_CASES, ids=[c[0] for c in EPILOGUE_CASES])
def test_fc2_dgrad_swiglu_matches_the_separate_references(name, offs, m, cfg):
    h_dim, inter = 20, 24  # I not a multiple of the 16-column tile; H leaves a partial reduction step
    dy, w2, h, probs, offs_t = inputs(offs, m, h_dim, inter, seed=m + len(offs))
    progs = 1 if cfg.block_m == 16 else 3
    end = offs[-1]
    for activation, p in (("swiglu", probs), ("swiglu_clamped", None), ("swiglu_clamped", probs)):
        poison = torch.full((m, 2 * inter), float("nan"), device=DEVICE)
        dh, dprobs = fused.fc2_dgrad_swiglu(dy, w2, offs_t, h, activation, p, config=cfg, num_programs=progs,
                                            out=poison)
        want_dh, want_dp = fused.fc2_dgrad_swiglu_ref(dy.double(), w2.double(), offs_t, h.double(), activation,
                                                      None if p is None else p.double())
        # rows past offs[-1] belong to no group: the reference's are the gradient of zero da, i.e. zero too
        assert rel_err(dh, want_dh) < FP32_BOUND, activation
        assert torch.equal(dh[end:], torch.zeros_like(dh[end:]))
        if p is None:
            assert dprobs is None
        else:
            assert rel_err(dprobs, want_dp) < FP32_BOUND and torch.equal(dprobs[end:], torch.zeros_like(dprobs[end:]))


def test_fc2_dgrad_swiglu_equals_the_dgrad_then_the_swiglu_backward_kernel():
    offs, m, h_dim, inter = [10, 10, 47, 60], 60, 20, 24
    dy, w2, h, probs, offs_t = inputs(offs, m, h_dim, inter, seed=3)
    cfg = CONFIGS[1]
    dh, dprobs = fused.fc2_dgrad_swiglu(dy, w2, offs_t, h, "swiglu", probs, config=cfg, num_programs=3)
    da = gg.grouped_gemm_dgrad(dy, w2, offs_t, config=cfg, num_programs=3)
    dh_sep, dprobs_sep = rows.swiglu_bwd(h, da, "swiglu", probs)
    torch.testing.assert_close(dh, dh_sep, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dprobs, dprobs_sep, rtol=1e-5, atol=1e-6)


def test_fc2_dgrad_swiglu_rejects_bad_arguments():
    dy, w2, h, probs, offs_t = inputs([4, 8], 8, 16, 8, seed=1)
    with pytest.raises(ValueError, match="activation"):
        fused.fc2_dgrad_swiglu(dy, w2, offs_t, h, "gelu")
    with pytest.raises(ValueError, match="probs"):
        fused.fc2_dgrad_swiglu(dy, w2, offs_t, h, "swiglu", probs[:-1])
    with pytest.raises(ValueError, match=r"\[M, 2I\]"):
        fused.fc2_dgrad_swiglu(dy, w2, offs_t, h[:, :-2])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
def test_fc2_dgrad_swiglu_bf16_on_gpu(activation):
    # skewed Qwen3-like groups: the autotuned kernel against the plain data gradient and the SwiGLU backward kernel
    torch.manual_seed(0)
    E, M, h_dim, inter = 16, 4000, 512, 384
    counts = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample().mul(M).floor().long()
    counts[0] += M - counts.sum()
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    bf = torch.bfloat16
    dy = torch.randn(M, h_dim, device="cuda", dtype=bf)
    w2 = (torch.randn(E, h_dim, inter, device="cuda") / inter**0.5).to(bf)
    h = (torch.randn(M, 2 * inter, device="cuda") * 3).to(bf)
    probs = torch.rand(M, device="cuda")
    dh, dprobs = fused.fc2_dgrad_swiglu(dy, w2, offs, h, activation, probs)
    dh_sep, dprobs_sep = rows.swiglu_bwd(h, gg.grouped_gemm_dgrad(dy, w2, offs), activation, probs)
    torch.testing.assert_close(dh, dh_sep, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dprobs, dprobs_sep, rtol=2e-2, atol=2e-2)
