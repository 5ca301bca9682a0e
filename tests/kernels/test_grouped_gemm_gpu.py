"""GPU checks of the Triton grouped GEMM (marked gpu; skipped without CUDA): bf16 at the real
expert shapes against float64 (a few groups) and torch._grouped_mm (everything), skewed routing
with empty groups and trailing rows, autograd through ops, and CUDA-graph replay with new routing
(the kernels are sync-free).

Legend: M routed rows, G experts, N = w.shape[1], K = w.shape[2]; fc1: N = 2I, K = H; fc2: N = H, K = I.
"""

import dataclasses

import pytest
import torch

from kernel_checks import (BF16_BOUND, check_graph_replays, check_groups_fp64, group_ranges as ranges,
                           skewed_offs_cuda as skewed_offs)

pytestmark = pytest.mark.gpu
pytest.importorskip("triton", reason="the triton package is not installed")

# (name, M, G, N, K): DeepSeek-V3 (256 experts x 256 rows, H 7168, I 2048), Qwen3-30B-A3B
# (128 experts x 1024 rows, H 2048, I 768).
REAL_SHAPES = [
    ("dsv3_fc1", 65536, 256, 4096, 7168),
    ("dsv3_fc2", 65536, 256, 7168, 2048),
    ("qwen3_fc1", 131072, 128, 1536, 2048),
    ("qwen3_fc2", 131072, 128, 2048, 768),
]


def kernels():
    from moetrain.kernels import grouped_gemm

    if grouped_gemm.interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process: the compiled kernels are unavailable")
    return grouped_gemm


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def chunked_rel_err(got, want):
    """Relative error of two large tensors without materializing fp32 copies of them whole."""
    chunk = max(1, (1 << 27) // max(1, got[0].numel()))
    num = den = 0.0
    for a, b in zip(got.split(chunk), want.split(chunk)):
        num += (a.float() - b.float()).pow(2).sum().item()
        den += b.float().pow(2).sum().item()
    return (num / den) ** 0.5


def balanced_offs(m, g):
    return torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)


def run_op(gg, op, m, g, n, k, offs, seed, with_torch=True):
    torch.manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5)
    if op == "fwd":
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = gg.grouped_gemm_fwd(x, w, offs, out=out)
        want = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs) if with_torch else None
        return got, want, x, w
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    if op == "dgrad":
        out = torch.full((m, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = gg.grouped_gemm_dgrad(dy, w, offs, out=out)
        want = torch._grouped_mm(dy, w, offs=offs) if with_torch else None
        return got, want, dy, w
    del w
    out = torch.full((g, n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = gg.grouped_gemm_wgrad(dy, x, offs, out=out)
    want = torch._grouped_mm(dy.t(), x, offs=offs) if with_torch else None
    return got, want, dy, x


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("name,m,g,n,k", REAL_SHAPES, ids=[s[0] for s in REAL_SHAPES])
def test_bf16_real_shapes(name, m, g, n, k, op):
    gg = kernels()
    offs = balanced_offs(m, g)
    got, want, a, b = run_op(gg, op, m, g, n, k, offs, seed=g + n)
    assert got.dtype == torch.bfloat16
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) outputs"
    assert chunked_rel_err(got, want) < BF16_BOUND
    check_groups_fp64(op, got, a, b, offs, sorted({0, 1, g // 2, g - 1} & set(range(g))))


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_bf16_skewed_routing_empty_groups_trailing_rows(op):
    gg = kernels()
    m, g, n, k = 20000, 64, 1536, 2048
    offs = skewed_offs(m, g, seed=3)
    got, _, a, b = run_op(gg, op, m, g, n, k, offs, seed=4, with_torch=False)
    assert not torch.isnan(got).any()
    empty = [i for i, (s, e) in enumerate(ranges(offs)) if s == e]
    assert empty
    check_groups_fp64(op, got, a, b, offs, sorted(set(range(0, g, 7)) | set(empty[:2])))
    if op != "wgrad":
        assert torch.equal(got[offs[-1].item():], torch.zeros_like(got[offs[-1].item():]))


def test_bf16_forward_gather_rows():
    gg = kernels()
    t, topk, g, n, k = 16384, 8, 128, 1536, 2048  # Qwen3-30B-A3B FC1, rows read from the tokens
    m = t * topk
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(g, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    rows = torch.randint(0, t, (m,), device="cuda", dtype=torch.int32)
    offs = skewed_offs(m, g, seed=6)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = gg.grouped_gemm_fwd(x, w, offs, gather_rows=rows, out=out)
    assert not torch.isnan(got).any()
    x_perm = x[rows.long()]
    check_groups_fp64("fwd", got, x_perm, w, offs, list(range(0, g, 9)))
    end = offs[-1].item()
    want = torch._grouped_mm(x_perm, w.transpose(-2, -1), offs=offs)
    assert chunked_rel_err(got[:end], want[:end]) < BF16_BOUND
    assert torch.equal(got[end:], torch.zeros_like(got[end:]))


def test_bf16_wgrad_gather_rows():
    gg = kernels()
    t, topk, g, n, k = 16384, 8, 128, 1536, 2048  # Qwen3-30B-A3B FC1 weight gradient, x read from the tokens
    m = t * topk
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    rows = torch.randint(0, t, (m,), device="cuda", dtype=torch.int32)
    offs = skewed_offs(m, g, seed=7)
    out = torch.full((g, n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = gg.grouped_gemm_wgrad(dy, x, offs, gather_rows=rows, out=out)
    assert not torch.isnan(got).any()
    x_perm = x[rows.long()]
    check_groups_fp64("wgrad", got, dy, x_perm, offs, list(range(0, g, 9)))
    want = gg.grouped_gemm_wgrad(dy, x_perm, offs)
    assert chunked_rel_err(got, want) < BF16_BOUND


def test_autograd_bf16_matches_fp64():
    from moetrain import ops

    kernels()
    m, g, n, k = 4096, 16, 512, 768
    offs = skewed_offs(m, g, seed=9, trailing=5)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(g, n, k, device="cuda") / k**0.5).to(torch.bfloat16).requires_grad_()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y = ops.grouped_gemm(x, w, offs, backend="triton")
    yr = ops.grouped_gemm(xr, wr, offs, backend="loop")
    assert rel_err(y, yr) < BF16_BOUND
    probe = torch.randn(m, n, device="cuda", dtype=torch.float64)
    (y.double() * probe).sum().backward()
    (yr * probe).sum().backward()
    assert rel_err(x.grad, xr.grad) < BF16_BOUND
    assert rel_err(w.grad, wr.grad) < BF16_BOUND


def test_cuda_graph_replay_with_new_routing():
    gg = kernels()
    m, g, n, k = 8192, 32, 1024, 512
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(g, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    offs = skewed_offs(m, g, seed=1)
    y, dx, dw = (torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in ((m, n), (m, k), (g, n, k)))

    def step():
        gg.grouped_gemm_fwd(x, w, offs, out=y)
        gg.grouped_gemm_dgrad(dy, w, offs, out=dx)
        gg.grouped_gemm_wgrad(dy, x, offs, out=dw)

    def check():
        ref_x, ref_dy, ref_w = x.double(), dy.double(), w.double()
        assert rel_err(y, gg.grouped_gemm_ref(ref_x, ref_w, offs)) < BF16_BOUND
        assert rel_err(dx, gg.grouped_gemm_dgrad_ref(ref_dy, ref_w, offs)) < BF16_BOUND
        assert rel_err(dw, gg.grouped_gemm_wgrad_ref(ref_dy, ref_x, offs)) < BF16_BOUND

    check_graph_replays(step, offs, m, (y, dx, dw), check)  # the first step compiles and autotunes


def _trial_cases():
    from moetrain.kernels import grouped_gemm_configs as tuning

    rowgroup = tuning.TRIAL_ROWGROUP_CONFIGS + tuning.PINGPONG_ROWGROUP_CONFIGS
    return ([("fwd", c) for c in rowgroup] + [("dgrad", c) for c in rowgroup]
            + [("wgrad", c) for c in tuning.TRIAL_WGRAD_CONFIGS + tuning.PINGPONG_WGRAD_CONFIGS
                                          + tuning.TRIAL_PINGPONG_WGRAD_CONFIGS]
            + [("wgrad_gather", c) for c in tuning.TRIAL_PINGPONG_GATHER_CONFIGS])


@pytest.mark.parametrize("cfg_index", range(6))  # (each of tuning.PINGPONG_WGRAD_CONFIGS)
def test_pingpong_wgrad_in_a_cuda_graph_with_new_routing(cfg_index):
    # the ping-pong weight gradient reads the routing on the device only: one capture, replayed on new routings
    gg = kernels()
    from moetrain.kernels import grouped_gemm_configs as tuning

    if not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("the ping-pong weight gradient is Hopper-only")
    assert len(tuning.PINGPONG_WGRAD_CONFIGS) == 6, "cfg_index's range must cover every candidate"
    cfg = tuning.PINGPONG_WGRAD_CONFIGS[cfg_index]
    m, g, n, k = 8192, 32, 1024, 512
    torch.manual_seed(7)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    offs = skewed_offs(m, g, seed=1)
    dw = torch.empty(g, n, k, device="cuda", dtype=torch.bfloat16)

    def check():
        assert rel_err(dw, gg.grouped_gemm_wgrad_ref(dy.double(), x.double(), offs)) < BF16_BOUND

    check_graph_replays(lambda: gg.grouped_gemm_wgrad(dy, x, offs, config=cfg, out=dw), offs, m, (dw,), check)


@pytest.mark.parametrize("op,cfg", _trial_cases(), ids=lambda v: str(v))
def test_bf16_trial_configs_on_skewed_routing(op, cfg):
    # the configs on trial (not yet picked by the autotuner): uneven and empty groups, trailing rows, bf16 vs fp64
    gg = kernels()
    m, g, n, k = 9000, 24, 768, 1024
    offs = skewed_offs(m, g, seed=11)
    torch.manual_seed(12)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    if op == "fwd":
        got = gg.grouped_gemm_fwd(x, w, offs, config=cfg, out=torch.full((m, n), float("nan"), device="cuda",
                                                                         dtype=torch.bfloat16))
        a, b = x, w
    elif op == "dgrad":
        got = gg.grouped_gemm_dgrad(dy, w, offs, config=cfg, out=torch.full((m, k), float("nan"), device="cuda",
                                                                           dtype=torch.bfloat16))
        a, b = dy, w
    elif op == "wgrad":
        got = gg.grouped_gemm_wgrad(dy, x, offs, config=cfg, out=torch.full((g, n, k), float("nan"), device="cuda",
                                                                           dtype=torch.bfloat16))
        a, b = dy, x
    else:  # x's rows read through an index with repeats (top-k copies of 3000 tokens), as FC1's weight gradient
        rows = torch.randint(0, m // 3, (m,), device="cuda", dtype=torch.int32)
        got = gg.grouped_gemm_wgrad(dy, x[: m // 3], offs, gather_rows=rows, config=cfg,
                                    out=torch.full((g, n, k), float("nan"), device="cuda", dtype=torch.bfloat16))
        a, b = dy, x[: m // 3][rows.long()]
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) outputs"
    check_groups_fp64("wgrad" if op == "wgrad_gather" else op, got, a, b, offs, list(range(g)))
    if op in ("fwd", "dgrad"):
        tail = offs[-1].item()
        assert torch.equal(got[tail:], torch.zeros_like(got[tail:]))


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_auto_asks_one_question_with_torch_beside_the_configs(op):
    # with_torch (backend "auto"): the first call of a shape asks the tuner once, torch._grouped_mm and every config
    # its candidates; the result is right whichever won, and the second call asks nothing
    gg = kernels()
    from moetrain import tuning

    m, g, n, k = 8192, 16, 512, 1024
    torch.manual_seed(6)
    a = torch.randn(m, n if op != "fwd" else k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 if op != "wgrad"
         else torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    offs = balanced_offs(m, g)
    fn = getattr(gg, f"grouped_gemm_{op}")
    from moetrain.kernels.torch_grouped_mm import torch_grouped_mm

    with tuning.use(tuning.Tuner()) as tuner:
        got = fn(a, b, offs, with_torch=True)
        again = fn(a, b, offs, with_torch=True)
    assert chunked_rel_err(got, torch_grouped_mm(op, a, b, offs)) < BF16_BOUND and torch.equal(got, again)
    (decision,) = tuner.decisions
    assert decision.key.startswith(f"gemm_{op}+torch|bfloat16|")
    assert decision.ms["torch"] is not None and len(decision.ms) > 5