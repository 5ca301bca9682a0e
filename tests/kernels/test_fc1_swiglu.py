"""FC1 with SwiGLU in its epilogue (moetrain.kernels.fc1_swiglu) against the float64 references (grouped GEMM,
then SwiGLU, times the row probabilities).

Without a GPU the kernel runs in Triton's CPU interpreter in float32 (bf16 dots are wrong there in triton 3.6);
with one, the same tests run compiled in float32, and test_fc1_swiglu_bf16_on_gpu checks bf16 against the
separate kernels. Outputs are poisoned with NaN before every run.
Legend: M rows, G experts, H hidden (the reduction), I expert intermediate.
"""

import pytest
import torch

from kernel_checks import EPILOGUE_CASES, FP32_BOUND, rel_err
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels import fc1_swiglu as fused  # noqa: E402
from moetrain.kernels import grouped_gemm as gg  # noqa: E402
from moetrain.kernels import moe_rows as rows  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"

pytestmark = pytest.mark.usefixtures("exact_fp32")  # tests/kernels/conftest.py

# block_n is both accumulators together: 32 -> 16 intermediate columns per tile
CONFIGS = [
    gg.GemmConfig(32, 32, 16, 1, 4, use_tma=False),
    gg.GemmConfig(32, 32, 16, 1, 4, use_tma=True),
    gg.GemmConfig(16, 32, 16, 1, 4, use_tma=True, group_m=2),
    gg.GemmConfig(32, 32, 16, 1, 4, use_tma=True, tail_split=True),
]


def poisoned(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def inputs(offs, m, h_dim, inter, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h_dim, generator=g)
    w1 = torch.randn(len(offs), 2 * inter, h_dim, generator=g) / h_dim**0.5
    probs = torch.rand(m, generator=g)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    return x.to(DEVICE, dtype), w1.to(DEVICE, dtype), probs.to(DEVICE), offs_t.to(DEVICE)


@pytest.mark.parametrize("paired,tma_h", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["paired_tma_h", "paired", "two_acc_tma_h", "two_acc"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("name,offs,m", EPILOGUE_CASES, ids=[c[0] for c in EPILOGUE_CASES])
def test_fc1_swiglu_matches_the_separate_references(name, offs, m, cfg, paired, tma_h):
    h_dim, inter = 20, 24  # I not a multiple of the 16-column tile; H leaves a partial reduction step
    x, w1, probs, offs_t = inputs(offs, m, h_dim, inter, seed=m + len(offs))
    progs = 1 if cfg.block_m == 16 else 3
    for activation, p in (("swiglu", probs), ("swiglu_clamped", None)):
        h, a = fused.fc1_swiglu(x, w1, offs_t, activation, p, config=cfg, num_programs=progs, paired=paired,
                                tma_h=tma_h, out=(poisoned(m, 2 * inter), poisoned(m, inter)))
        want_h, want_a = fused.fc1_swiglu_ref(x.double(), w1.double(), offs_t, activation,
                                              None if p is None else p.double())
        assert rel_err(h, want_h) < FP32_BOUND and rel_err(a, want_a) < FP32_BOUND, activation
        end = offs[-1]
        assert torch.equal(h[end:], torch.zeros_like(h[end:])) and torch.equal(a[end:], torch.zeros_like(a[end:]))


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "two_acc"])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=str)
def test_fc1_swiglu_gathers_token_rows(cfg, paired):
    T, K, h_dim, inter = 9, 3, 20, 24
    offs = [5, 5, 19, 27]
    g = torch.Generator().manual_seed(5)
    x, w1, probs, offs_t = inputs(offs, T, h_dim, inter, seed=7)
    probs = torch.rand(T * K, generator=g).to(DEVICE)
    rows_of = torch.randperm(T * K, generator=g).to(DEVICE) // K  # token of each grouped row
    h, a = fused.fc1_swiglu(x, w1, offs_t, "swiglu", probs, gather_rows=rows_of, config=cfg, num_programs=2,
                            paired=paired, out=(poisoned(T * K, 2 * inter), poisoned(T * K, inter)))
    want_h, want_a = fused.fc1_swiglu_ref(x.double(), w1.double(), offs_t, "swiglu", probs.double(),
                                          gather_rows=rows_of)
    assert rel_err(h, want_h) < FP32_BOUND and rel_err(a, want_a) < FP32_BOUND


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "two_acc"])
def test_fc1_swiglu_equals_the_gemm_then_the_swiglu_kernel(paired):
    # The fused epilogue computes SwiGLU from h as stored: the same numbers as the two kernels it replaces.
    offs, m, h_dim, inter = [10, 10, 47, 60], 60, 20, 24
    x, w1, probs, offs_t = inputs(offs, m, h_dim, inter, seed=3)
    cfg = CONFIGS[1]
    h, a = fused.fc1_swiglu(x, w1, offs_t, "swiglu", probs, config=cfg, num_programs=3, paired=paired)
    h_sep = gg.grouped_gemm_fwd(x, w1, offs_t, config=cfg, num_programs=3)
    a_sep = rows.swiglu_fwd(h_sep, "swiglu", probs)
    torch.testing.assert_close(h, h_sep, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a, a_sep, rtol=1e-6, atol=1e-6)


def test_fc1_swiglu_rejects_bad_arguments():
    x, w1, probs, offs_t = inputs([4, 8], 8, 16, 8, seed=1)
    with pytest.raises(ValueError, match="activation"):
        fused.fc1_swiglu(x, w1, offs_t, "gelu")
    with pytest.raises(ValueError, match="probs"):
        fused.fc1_swiglu(x, w1, offs_t, "swiglu", probs[:-1])
    with pytest.raises(ValueError, match=r"\[M, H\]"):
        fused.fc1_swiglu(x[:, :-1], w1, offs_t)


@pytest.mark.gpu
@pytest.mark.parametrize("paired,tma_h", [(True, True), (True, False), (False, False)],
                         ids=["paired_tma_h", "paired", "two_acc"])
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
@pytest.mark.parametrize("gather", [False, True])
def test_fc1_swiglu_bf16_on_gpu(activation, gather, paired, tma_h):
    # Qwen3-like rows per expert, skewed: the autotuned kernel against the plain forward and the SwiGLU kernel
    torch.manual_seed(0)
    E, T, K, h_dim, inter = 16, 1000, 4, 512, 384
    counts = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample().mul(T * K).floor().long()
    counts[0] += T * K - counts.sum()
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    x = torch.randn(T if gather else T * K, h_dim, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(E, 2 * inter, h_dim, device="cuda") / h_dim**0.5).to(torch.bfloat16)
    probs = torch.rand(T * K, device="cuda")
    rows_of = torch.randperm(T * K, device="cuda") // K if gather else None
    h, a = fused.fc1_swiglu(x, w1, offs, activation, probs, gather_rows=rows_of, paired=paired, tma_h=tma_h)
    h_sep = gg.grouped_gemm_fwd(x, w1, offs, gather_rows=rows_of)
    a_sep = rows.swiglu_fwd(h_sep, activation, probs)
    torch.testing.assert_close(h, h_sep, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(a, a_sep, rtol=2e-2, atol=2e-2)
