"""GPU checks of the warp-specialized ping-pong weight gradient (kernels/wgrad_pingpong.py, Gluon; marked
gpu, skipped without a Hopper GPU): bf16 against float64 per group on skewed routing with empty groups and trailing
rows, and against torch._grouped_mm at DeepSeek-V3's and Qwen3's FC1 shapes (fewer experts, same rows per expert);
x's rows gathered through an index (the fourth, cp.async warpgroup) against float64 and against the permuted copy.
A hang here is a barrier-phase bug: the device scripts run this file under a timeout."""

import pytest
import torch

from kernel_checks import BF16_BOUND, check_groups_fp64, hopper_kernels, skewed_offs_cuda

pytestmark = pytest.mark.gpu
pytest.importorskip("triton", reason="the triton package is not installed")


def kernel():
    return hopper_kernels("wgrad_pingpong")


M, G, N, K = 9000, 24, 768 + 64, 1024 + 8  # skewed-routing tests: partial tiles over N and K


@pytest.mark.parametrize("tile, stages, group_n", [((128, 128), 3, 8), ((128, 128), 4, 1), ((128, 128), 5, 8),
                                                   ((64, 256), 4, 8), ((64, 256), 3, 4)])
def test_matches_float64_on_skewed_routing(tile, stages, group_n):
    wp = kernel()
    offs = skewed_offs_cuda(M, G, seed=11)
    torch.manual_seed(12)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    got = wp.grouped_gemm_wgrad_pingpong(dy, x, offs, stages=stages, group_n=group_n, tile=tile,
                                         out=torch.full((G, N, K), float("nan"), device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) outputs"
    check_groups_fp64("wgrad", got, dy, x, offs, range(G))


def check_same_tiles_as_plain(offs, seed: int, programs, **schedule):
    """A schedule (cohorts=, mix=, sorted_groups=) only reorders tiles: each dw tile is reduced in the same order by the same code,
    so the result is bitwise the plain kernel's; every output written (NaN-poisoned first) and exact against
    float64."""
    wp = kernel()
    torch.manual_seed(seed)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    poisoned = torch.full((G, N, K), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = wp.grouped_gemm_wgrad_pingpong(dy, x, offs, out=poisoned, num_programs=programs, **schedule)
    plain = wp.grouped_gemm_wgrad_pingpong(dy, x, offs, num_programs=programs)
    torch.cuda.synchronize()
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) outputs"
    assert torch.equal(got, plain)
    check_groups_fp64("wgrad", got, dy, x, offs, range(G))


@pytest.mark.parametrize("cohorts, programs", [(2, None), (4, None), (4, 7), (2, 3)])
def test_cohorts_compute_the_same_tiles_in_another_order(cohorts, programs):
    kernel()
    check_same_tiles_as_plain(skewed_offs_cuda(M, G, seed=11), 14, programs, cohorts=cohorts)


def routed_ends(routing: str) -> torch.Tensor:
    """[G] int32 group ends of M rows: skewed (empty groups, trailing rows) or balanced."""
    if routing == "skewed":
        return skewed_offs_cuda(M, G, seed=11)
    return torch.arange(1, G + 1, device="cuda", dtype=torch.int32) * (M // G)


@pytest.mark.parametrize("routing", ["skewed", "balanced"])
@pytest.mark.parametrize("programs", [None, 7])
def test_mix_computes_the_same_tiles_in_another_order(routing, programs):
    # "mix" reorders groups (heaviest first) and, on skewed routing, walks half the programs' tiles backwards and
    # deals odd rounds in reverse program order
    kernel()
    from moetrain.kernels.schedule import skew_schedule

    offs = routed_ends(routing)
    assert skew_schedule(offs)[-1].item() == (routing == "skewed")  # both schedules taken
    check_same_tiles_as_plain(offs, 15, programs, mix=True)


@pytest.mark.parametrize("routing", ["skewed", "balanced"])
@pytest.mark.parametrize("programs", [None, 7])
def test_sorted_groups_compute_the_same_tiles_in_another_order(routing, programs):
    # groups heaviest first (mix's order), every program in step
    kernel()
    check_same_tiles_as_plain(routed_ends(routing), 18, programs, sorted_groups=True)


def test_cohorts_outside_the_choices_are_refused():
    wp = kernel()
    dy = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([64], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="cohorts=3"):
        wp.grouped_gemm_wgrad_pingpong(dy, dy, offs, cohorts=3)
    with pytest.raises(ValueError, match="choose one"):
        wp.grouped_gemm_wgrad_pingpong(dy, dy, offs, cohorts=2, mix=True)
    with pytest.raises(ValueError, match="choose one"):
        wp.grouped_gemm_wgrad_pingpong(dy, dy, offs, mix=True, sorted_groups=True)


@pytest.mark.parametrize("m, g, n, k", [(65536 // 8, 32, 4096, 7168), (131072 // 8, 16, 1536, 2048)],
                         ids=["dsv3_fc1", "qwen3_fc1"])
def test_matches_torch_at_the_expert_shapes(m, g, n, k):
    wp = kernel()
    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)
    torch.manual_seed(13)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = wp.grouped_gemm_wgrad_pingpong(dy, x, offs)
    want = torch._grouped_mm(dy.t(), x, offs=offs)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < BF16_BOUND, err


@pytest.mark.parametrize("stages", [3, 4])
def test_gathered_rows_match_float64_on_skewed_routing(stages):
    # x's rows through an index with repeats (top-8 copies of each token), copied by the gathering warpgroup
    wp = kernel()
    t, topk, g, n, k = 1200, 8, 24, 768 + 64, 1024
    m = t * topk
    offs = skewed_offs_cuda(m, g, seed=21)
    torch.manual_seed(22)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    rows = torch.randint(0, t, (m,), device="cuda", dtype=torch.int32)
    got = wp.grouped_gemm_wgrad_pingpong(dy, x, offs, stages=stages, gather_rows=rows,
                                         out=torch.full((g, n, k), float("nan"), device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) outputs"
    check_groups_fp64("wgrad", got, dy, x[rows.long()], offs, range(g))


def test_gathered_rows_match_the_copy_at_qwen3_fc1():
    wp = kernel()
    t, topk, g, n, k = 16384, 8, 128, 1536, 2048
    m = t * topk
    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)
    torch.manual_seed(23)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    rows = torch.randperm(m, device="cuda").remainder(t).to(torch.int32)
    got = wp.grouped_gemm_wgrad_pingpong(dy, x, offs, gather_rows=rows)
    want = wp.grouped_gemm_wgrad_pingpong(dy, x[rows.long()], offs)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-6, err  # the same products in the same order: equal up to nothing
