"""Triton grouped GEMM (forward, dgrad, wgrad, autograd) against a float64 reference.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
triton is imported) in float32: the interpreter computes bf16 dots wrongly in triton 3.6, so bf16
is covered by test_grouped_gemm_gpu.py. With a GPU the same tests run the compiled kernels on
CUDA in float32 (IEEE dots). Outputs are poisoned with NaN before every run.

Legend: M rows, G groups, N = w.shape[1], K = w.shape[2].
"""

import dataclasses

import pytest
import torch

from kernel_checks import FP32_BOUND, rel_err, script_result
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain import ops  # noqa: E402
from moetrain.errors import UserError  # noqa: E402
from moetrain.kernels import grouped_gemm as gg  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"

# (name, offs, M): uneven and empty groups, one group holding everything, G=1, M not a multiple
# of any block, trailing rows past offs[-1], and every row trailing.
CASES = [
    ("uneven_empty_trailing", [10, 10, 47, 60], 70),
    ("single_group_all_rows", [0, 50, 50], 50),
    ("one_group", [37], 37),
    ("all_trailing", [0, 0], 5),
    ("many_groups", [3, 3, 20, 21, 40, 40, 58], 61),
]
CONFIGS = [
    gg.GemmConfig(32, 32, 16, 1, 4, use_tma=False),
    gg.GemmConfig(32, 32, 16, 1, 4, use_tma=True),
    gg.GemmConfig(16, 32, 16, 1, 4, use_tma=True, group_m=2),  # several row tiles per band
    gg.GemmConfig(32, 32, 16, 1, 4, use_tma=True, tail_split=True),  # remainders <= 16 rows: a 16-row launch
    gg.GemmConfig(32, 32, 16, 1, 4, use_tma=False, tail_split=True, group_m=2),
]


pytestmark = pytest.mark.usefixtures("exact_fp32")  # tests/kernels/conftest.py


def poisoned(*shape):
    return torch.full(shape, float("nan"), device=DEVICE)


def make(offs, m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(len(offs), n, k, generator=g)
    dy = torch.randn(m, n, generator=g)
    return x.to(DEVICE), w.to(DEVICE), dy.to(DEVICE), torch.tensor(offs, dtype=torch.int32, device=DEVICE)


def group_rows(offs, m):
    start = 0
    for end in offs:
        yield start, end
        start = end


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("name,offs,m", CASES, ids=[c[0] for c in CASES])
def test_forward_dgrad_wgrad_match_fp64(name, offs, m, cfg):
    n, k = 40, 20  # neither a multiple of 32; K=20 leaves a partial reduction step
    x, w, dy, offs_t = make(offs, m, n, k, seed=m + len(offs))
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    progs = 1 if cfg.block_m == 16 else 3  # one program walks every tile; several share them

    y = gg.grouped_gemm_fwd(x, w, offs_t, config=cfg, out=poisoned(m, n), num_programs=progs)
    want = gg.grouped_gemm_ref(x64, w64, offs_t)
    assert rel_err(y, want) < FP32_BOUND
    assert torch.equal(y[offs[-1]:], torch.zeros_like(y[offs[-1]:]))

    dx = gg.grouped_gemm_dgrad(dy, w, offs_t, config=cfg, out=poisoned(m, k), num_programs=progs)
    want = gg.grouped_gemm_dgrad_ref(dy64, w64, offs_t)
    assert rel_err(dx, want) < FP32_BOUND
    assert torch.equal(dx[offs[-1]:], torch.zeros_like(dx[offs[-1]:]))

    dw = gg.grouped_gemm_wgrad(dy, x, offs_t, config=cfg, out=poisoned(len(offs), n, k), num_programs=progs)
    want = gg.grouped_gemm_wgrad_ref(dy64, x64, offs_t)
    assert rel_err(dw, want) < FP32_BOUND
    for gi, (s, e) in enumerate(group_rows(offs, m)):
        if s == e:
            assert torch.equal(dw[gi], torch.zeros_like(dw[gi])), f"empty group {gi} not zero"


@pytest.mark.parametrize("band,tma_store", [(1, True), (2, True), (3, True), (3, False)])
def test_wgrad_tile_bands_cover_every_tile(band, tma_store):
    # dw[g] of 5 x 2 tiles of 16 x 16 in bands of 1, 2 or 3 tile rows (3 leaves a short last band), by
    # 2 programs: every tile written once, in any order; TMA loads with TMA or register stores (K=24 leaves a
    # partial dw column tile, which the register store must mask).
    offs, m, n, k = [30, 30, 71], 75, 80, 24
    x, _, dy, offs_t = make(offs, m, n, k, seed=23)
    cfg = gg.GemmConfig(16, 16, 16, 1, 4, use_tma=True, group_m=band, tma_store=tma_store)
    dw = gg.grouped_gemm_wgrad(dy, x, offs_t, config=cfg, out=poisoned(len(offs), n, k), num_programs=2)
    assert rel_err(dw, gg.grouped_gemm_wgrad_ref(dy.double(), x.double(), offs_t)) < FP32_BOUND
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))  # the empty group


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=str)
def test_forward_gather_rows_matches_permuted_copy(cfg):
    # The fused-expert forward: A rows read through an index array (repeats: top-k copies).
    offs, m, t, n, k = [9, 9, 30, 44], 47, 20, 40, 20
    x_src, w, _, offs_t = make(offs, t, n, k, seed=21)
    rows = torch.randint(0, t, (m,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    y = gg.grouped_gemm_fwd(x_src, w, offs_t, gather_rows=rows, config=cfg, out=poisoned(m, n), num_programs=2)
    want = gg.grouped_gemm_ref(x_src.double()[rows], w.double(), offs_t)
    assert rel_err(y, want) < FP32_BOUND
    assert torch.equal(y[44:], torch.zeros(3, n, device=DEVICE))


@pytest.mark.parametrize("cfg", gg.WGRAD_CONFIGS[:2], ids=str)
def test_wgrad_gather_rows_matches_permuted_copy(cfg):
    # The fused-expert FC1 weight gradient: x rows read through an index array, with an empty group
    # and rows past the last group (they must not contribute).
    offs, m, t, n, k = [9, 9, 30, 44], 47, 20, 40, 24
    x_src, _, _, offs_t = make(offs, t, n, k, seed=22)
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    rows = torch.randint(0, t, (m,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    dw = gg.grouped_gemm_wgrad(dy, x_src, offs_t, gather_rows=rows, config=cfg, out=poisoned(len(offs), n, k),
                               num_programs=2)
    want = gg.grouped_gemm_wgrad_ref(dy.double(), x_src.double()[rows], offs_t)
    assert rel_err(dw, want) < FP32_BOUND
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))  # the empty group


def test_reference_matches_explicit_loop():
    x, w, dy, offs_t = make([4, 4, 9], 11, 6, 5, seed=1)
    x, w, dy = x.double(), w.double(), dy.double()
    y = gg.grouped_gemm_ref(x, w, offs_t)
    torch.testing.assert_close(y[4:9], x[4:9] @ w[2].T)
    torch.testing.assert_close(y[:4], x[:4] @ w[0].T)
    assert torch.equal(y[9:], torch.zeros(2, 6, dtype=y.dtype, device=y.device))
    dw = gg.grouped_gemm_wgrad_ref(dy, x, offs_t)
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))
    torch.testing.assert_close(dw[2], dy[4:9].T @ x[4:9])


def test_unaligned_rows_fall_back_to_pointer_loads():
    # K=13 fp32: row stride 52 bytes is not 16-byte aligned, so a TMA config must use pointer loads.
    offs = [5, 5, 17]
    x, w, dy, offs_t = make(offs, 19, 24, 13, seed=7)
    cfg = gg.GemmConfig(32, 32, 16, 1, 4, use_tma=True)
    assert not gg._tma_ok(x)
    y = gg.grouped_gemm_fwd(x, w, offs_t, config=cfg, out=poisoned(19, 24))
    assert rel_err(y, gg.grouped_gemm_ref(x.double(), w.double(), offs_t)) < FP32_BOUND
    dw = gg.grouped_gemm_wgrad(dy, x, offs_t, config=cfg, out=poisoned(3, 24, 13))
    assert rel_err(dw, gg.grouped_gemm_wgrad_ref(dy.double(), x.double(), offs_t)) < FP32_BOUND


def test_pingpong_rowgroup_configs_refused_where_they_cannot_run():
    # the Gluon ping-pong forward / data gradient: candidates of fwd and dgrad (not of the gathered forward); where
    # it cannot run (CPU, interpreter, not Hopper, not bf16) an explicit request is a clear error
    pingpong = gg.PINGPONG_ROWGROUP_CONFIGS[0]
    assert str(pingpong) == "pingpong/128x128x64/s4/g8"
    assert pingpong in gg.configs_for("fwd", trial=False) and pingpong in gg.configs_for("dgrad", trial=False)
    assert pingpong not in gg.configs_for("fwd_gather")
    x, w, dy, offs_t = make([6, 6, 30], 33, 16, 24, seed=4)
    if gg.pingpong_applies(x.to(torch.bfloat16)):
        pytest.skip("this GPU runs the ping-pong kernel (its GPU tests cover it)")
    with pytest.raises(ValueError, match="needs a Hopper GPU, bf16"):
        gg.grouped_gemm_fwd(x, w, offs_t, config=pingpong)
    with pytest.raises(ValueError, match="needs a Hopper GPU, bf16"):
        gg.grouped_gemm_dgrad(dy, w, offs_t, config=pingpong)


def test_pingpong_wgrad_config_refused_where_it_cannot_run():
    # the Gluon ping-pong kernel needs compiled kernels on a Hopper GPU and bf16: elsewhere an explicit request is a
    # clear error, and the autotuner never offers it
    pingpong = gg.PINGPONG_WGRAD_CONFIGS[0]
    assert str(pingpong) == "pingpong/128x128x64/s4/g8"
    assert pingpong in gg.configs_for("wgrad", trial=False)
    assert pingpong not in gg.configs_for("wgrad_gather", trial=False)  # gathering: on trial only
    x, _, dy, offs_t = make([6, 6, 30], 33, 16, 24, seed=3)
    if gg.pingpong_applies(dy.to(torch.bfloat16)):
        pytest.skip("this GPU runs the ping-pong kernel (its GPU tests cover it)")
    with pytest.raises(ValueError, match="needs a Hopper GPU, bf16"):
        gg.grouped_gemm_wgrad(dy, x, offs_t, config=pingpong)


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_skew_schedule_orders_groups_and_flags_skew_without_a_sync(impl):
    # the "sorted" and "mix" schedules: groups heaviest first (ties in order), and the flag set when at least 1/8 of
    # the groups have under one reduction step (64 rows) of rows; the Triton launch and its PyTorch reference
    from moetrain.kernels import schedule
    from moetrain.kernels.schedule import SKEWED_SHARE

    made = schedule.skew_schedule if impl == "kernel" else schedule.skew_schedule_torch

    def skew_schedule(offs):
        return made(offs.to(DEVICE)).cpu()

    balanced = torch.arange(1, 9, dtype=torch.int32) * 256
    assert skew_schedule(balanced).tolist() == list(range(8)) + [0]
    rows = [300, 0, 5, 900, 64, 63, 300, 2000]  # 3 of 8 groups under 64 rows
    sched = skew_schedule(torch.cumsum(torch.tensor(rows), 0).to(torch.int32))
    assert sched.dtype == torch.int32 and sched.tolist() == [7, 3, 0, 6, 4, 5, 2, 1, 1]
    def flag(small_groups: int, groups: int = 16) -> int:
        ends = torch.cumsum(torch.tensor([100] * (groups - small_groups) + [10] * small_groups), 0)
        return skew_schedule(ends.to(torch.int32))[-1].item()

    assert SKEWED_SHARE == 8 and (flag(1), flag(2), flag(3)) == (0, 1, 1)  # 1/8 of 16 groups is 2


@pytest.mark.parametrize("groups", [1, 7, 16, 300])
def test_skew_schedule_kernel_matches_torch(groups):
    # ties (few distinct row counts), empty groups, more groups than one block of places, int32 and int64 ends
    from moetrain.kernels.schedule import skew_schedule, skew_schedule_torch

    g = torch.Generator().manual_seed(groups)
    rows = torch.randint(0, 6, (groups,), generator=g) * torch.randint(0, 40, (1,), generator=g)
    for dtype in (torch.int32, torch.int64):
        ends = torch.cumsum(rows, 0).to(dtype).to(DEVICE)
        got, want = skew_schedule(ends), skew_schedule_torch(ends)
        assert got.dtype == torch.int32 and torch.equal(got, want), (dtype, rows.tolist())


MIX_CASES = [
    # skewed (3 of 6 groups under 64 rows: the flag set, half the programs walk backwards), trailing rows
    ("skewed", [150, 150, 160, 230, 231, 240], 250),
    ("balanced", [70, 140, 210, 280], 285),  # every group >= 64 rows: the flag unset, groups heaviest first
]


@pytest.mark.parametrize("name,offs,m", MIX_CASES, ids=[c[0] for c in MIX_CASES])
@pytest.mark.parametrize("cfg", [gg.GemmConfig(32, 32, 16, 1, 4, use_tma=True, tail_split=True, mix=True),
                                 gg.GemmConfig(32, 32, 16, 1, 4, use_tma=False, group_m=2, mix=True)], ids=str)
@pytest.mark.parametrize("programs", [3, 4])
def test_mix_schedule_forward_and_dgrad(name, offs, m, cfg, programs):
    # the forward / data gradient with the groups in schedule.skew_schedule's order (and on skewed routing half the
    # programs walking backwards): the same tiles as the plain schedule, so the same result bit for bit; and exact
    # against the float64 reference, every output row written (poisoned before)
    from moetrain.kernels.schedule import skew_schedule

    x, w, dy, offs_t = make(offs, m, 40, 24, seed=21)
    assert skew_schedule(offs_t)[-1].item() == (name == "skewed")
    plain = dataclasses.replace(cfg, mix=False)
    y = gg.grouped_gemm_fwd(x, w, offs_t, config=cfg, out=poisoned(m, 40), num_programs=programs)
    assert rel_err(y, gg.grouped_gemm_ref(x.double(), w.double(), offs_t)) < FP32_BOUND
    assert torch.equal(y, gg.grouped_gemm_fwd(x, w, offs_t, config=plain, num_programs=programs))
    dx = gg.grouped_gemm_dgrad(dy, w, offs_t, config=cfg, out=poisoned(m, 24), num_programs=programs)
    assert rel_err(dx, gg.grouped_gemm_dgrad_ref(dy.double(), w.double(), offs_t)) < FP32_BOUND
    assert torch.equal(dx, gg.grouped_gemm_dgrad(dy, w, offs_t, config=plain, num_programs=programs))


def test_default_config_path_and_shape_errors():
    offs = [6, 6, 30]
    x, w, dy, offs_t = make(offs, 33, 16, 24, seed=3)
    y = gg.grouped_gemm_fwd(x, w, offs_t)  # autotuned on a GPU, the interpreter config on CPU
    assert rel_err(y, gg.grouped_gemm_ref(x.double(), w.double(), offs_t)) < FP32_BOUND
    with pytest.raises(ValueError, match="must be"):
        gg.grouped_gemm_fwd(x, w.transpose(1, 2), offs_t)
    with pytest.raises(ValueError, match="dtypes differ"):
        gg.grouped_gemm_fwd(x, w.double(), offs_t)


def test_autograd_function_matches_loop_backend():
    offs = [7, 7, 25, 31]
    m, n, k = 36, 24, 16
    x, w, _, offs_t = make(offs, m, n, k, seed=11)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    ref_leaves = [x.double().requires_grad_(), w.double().requires_grad_()]
    y = ops.grouped_gemm(leaves[0], leaves[1], offs_t, backend="triton")
    want = ops.grouped_gemm(ref_leaves[0], ref_leaves[1], offs_t, backend="loop")
    assert y.dtype == torch.float32
    assert rel_err(y, want.detach()) < FP32_BOUND
    probe = torch.randn(m, n, dtype=torch.float64, device=DEVICE)
    (y * probe.float()).sum().backward()
    (want * probe).sum().backward()
    for got, ref in zip(leaves, ref_leaves):
        assert rel_err(got.grad, ref.grad) < FP32_BOUND
    assert torch.equal(leaves[0].grad[31:], torch.zeros(5, k, device=DEVICE))
    assert torch.equal(leaves[1].grad[1], torch.zeros(n, k, device=DEVICE))  # empty group


def test_moe_experts_triton_backend_matches_reference():
    t, h, i, e, topk = 23, 16, 8, 4, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, h, generator=g)
    w1 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
    idx[:, 0] = torch.where(idx[:, 1] == 1, 2, 1)  # expert 0 only as a second choice: skew
    idx[::5, 1] = -1  # dropped assignments: trailing rows
    weight = torch.rand(t, topk, generator=g)
    args = [a.to(DEVICE) for a in (x, idx, weight, w1, w2)]
    leaves = [args[0].clone().requires_grad_(), args[3].clone().requires_grad_(), args[4].clone().requires_grad_()]
    ref_leaves = [a.double().requires_grad_() for a in (args[0], args[3], args[4])]
    got = ops.moe_experts(leaves[0], args[1], args[2], leaves[1], leaves[2], backend="triton")
    want = ops.moe_experts(ref_leaves[0], args[1], args[2].double(), ref_leaves[1], ref_leaves[2], backend="reference")
    assert rel_err(got, want.detach()) < FP32_BOUND
    probe = torch.randn(t, h, dtype=torch.float64, device=DEVICE)
    (got * probe.float()).sum().backward()
    (want * probe).sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert rel_err(a.grad, b.grad) < 1e-4


def test_resolve_backend_triton(monkeypatch):
    assert ops.resolve_backend("triton", torch.device(DEVICE)) == "triton"
    if not ON_GPU:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(UserError, match="TRITON_INTERPRET=1"):
            ops.resolve_backend("triton", torch.device("cpu"))
    from moetrain.ops import autoselect

    monkeypatch.setattr(autoselect, "triton_available", lambda: False)  # as without the package
    with pytest.raises(UserError, match="triton package"):
        ops.resolve_backend("triton", torch.device(DEVICE))


def test_ops_import_does_not_import_triton():
    code = "import sys, moetrain.ops; assert 'triton' not in sys.modules, 'moetrain.ops imported triton'"
    script_result(code)  # fails the test unless the script exits 0


def _timing_by_table(monkeypatch):
    """pick_config as on a GPU, with queued_ms returning what the timed ``run`` returns (its table's entry)."""
    from moetrain.kernels import grouped_gemm_tuning as tuning

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "_BEST", {})
    monkeypatch.setattr(tuning, "_to_disk", lambda *a: None)
    monkeypatch.setattr(tuning, "queued_ms", lambda run, **kw: run())
    return tuning


def test_autotuner_takes_the_fastest_whether_tail_split_or_not(monkeypatch):
    # No preference for tail-split configs (session 20: a 3% one cost DeepSeek-V3's FC1 forward 1-3%): the skewed
    # routing in the timed sum measures what the split saves on uneven routing
    tuning = _timing_by_table(monkeypatch)  # the "run" below returns its time
    plain, split, other = (gg.GemmConfig(128, 256, 64, 3, 8), gg.GemmConfig(128, 256, 64, 3, 8, tail_split=True),
                           gg.GemmConfig(128, 128, 64, 4, 4, tail_split=True))
    for times, want in (({plain: 1.00, split: 1.02, other: 1.5}, plain),
                        ({plain: 1.02, split: 1.00, other: 1.5}, split)):
        assert tuning.pick_config(("fwd", str(want)), (plain, split, other), None, lambda cfg: times[cfg]) == want


def test_autotuner_judges_candidates_on_both_routings(monkeypatch):
    # with run_skewed, a candidate's time is its caller-routing time plus its skewed-routing time: the config that
    # leads on balanced routing but collapses on skewed loses
    tuning = _timing_by_table(monkeypatch)  # the "run" below returns its time
    fast, steady = gg.GemmConfig(128, 128, 64, 4, 4), gg.GemmConfig(128, 256, 64, 3, 8)
    balanced, skewed = {fast: 7.5, steady: 8.9}, {fast: 10.3, steady: 9.7}
    assert tuning.pick_config(("wgrad", 1), (fast, steady), None, lambda c: balanced[c]) == fast
    assert tuning.pick_config(("wgrad", 2), (fast, steady), None, lambda c: balanced[c], lambda c: skewed[c]) == fast
    skewed[fast] = 12.0  # 19.5 against 18.6
    assert tuning.pick_config(("wgrad", 3), (fast, steady), None, lambda c: balanced[c], lambda c: skewed[c]) == steady


def test_autotuner_prefers_a_config_as_fast_as_torch_on_both_routings(monkeypatch):
    # "fast" wins the sum but loses to torch._grouped_mm on balanced routing (session 20: DeepSeek-V3's FC2 forward at
    # 0.99x); "safe" is slower on the sum yet at least torch's speed on both, and wins; the peer itself never does
    tuning = _timing_by_table(monkeypatch)
    peer = tuning.PEER
    fast, safe = gg.GemmConfig(128, 128, 64, 5, 4, kernel="pingpong"), gg.GemmConfig(128, 256, 64, 3, 8)
    balanced = {fast: 3.52, safe: 3.36, peer: 3.49}
    skewed = {fast: 4.15, safe: 4.45, peer: 4.70}
    pick = lambda key, cands: tuning.pick_config(  # noqa: E731
        key, cands, None, lambda c: balanced[c], lambda c: skewed[c], peer=True)
    assert pick(("fwd", 1), (fast, safe)) == safe
    verdict = tuning.tuning_verdicts()[("fwd", 1)]  # what bench gemm prints: the rule, both times, the sum's winner
    assert verdict == {"rule": "as fast as torch on each routing", "sum_winner": str(fast), "best_ms": (3.36, 4.45),
                       "peer_ms": (3.49, 4.70)}
    # without the peer, the sum decides as before
    assert tuning.pick_config(("fwd", 2), (fast, safe), None, lambda c: balanced[c], lambda c: skewed[c]) == fast
    # no candidate as fast as torch on both routings: the sum decides
    balanced[safe] = 3.60
    assert pick(("fwd", 3), (fast, safe)) == fast
    assert tuning.tuning_verdicts()[("fwd", 3)]["rule"].startswith("fastest on the sum (none")
    # the peer fastest on everything: still a candidate is returned (auto's torch-or-triton choice decides next)
    balanced[peer], skewed[peer] = 1.0, 1.0
    assert pick(("fwd", 4), (fast, safe)) == fast


def test_autotuner_times_the_best_safe_config_again_even_outside_the_finalists(monkeypatch):
    # the fastest safe candidate of the first pass joins the finalists' longer timing, with the peer
    tuning = _timing_by_table(monkeypatch)
    peer = tuning.PEER
    configs = [gg.GemmConfig(128, 128, 64, s, 4, kernel="pingpong") for s in (3, 4, 5)] + [
        gg.GemmConfig(128, 256, 64, 3, 8)]
    balanced = dict(zip(configs, (3.50, 3.51, 3.52, 3.30))) | {peer: 3.40}
    skewed = dict(zip(configs, (4.00, 4.01, 4.02, 4.60))) | {peer: 4.70}
    timed = []

    def run(c):
        timed.append(c)
        return balanced[c]

    assert tuning.FINALISTS == 3
    assert tuning.pick_config(("fwd", "safe"), tuple(configs), None, run, lambda c: skewed[c], peer=True) == configs[3]
    assert timed.count(configs[3]) == tuning.TUNE_ROUNDS + tuning.FINAL_ROUNDS
    assert timed.count(peer) == tuning.TUNE_ROUNDS + tuning.FINAL_ROUNDS


def test_autotuner_ignores_a_peer_that_cannot_run(monkeypatch):
    tuning = _timing_by_table(monkeypatch)
    a, b = gg.GemmConfig(128, 128, 64, 4, 4), gg.GemmConfig(128, 256, 64, 3, 8)

    def run(c):
        if c is tuning.PEER:
            raise RuntimeError("torch._grouped_mm: not on this GPU")
        return {a: 2.0, b: 1.0}[c]

    assert tuning.pick_config(("wgrad", "no peer"), (a, b), None, run, peer=True) == b


def test_kernels_time_their_candidates_on_a_skewed_routing_of_the_same_rows(monkeypatch):
    # the launchers hand pick_config a run_skewed over runtime.timing.skewed_offs (same rows and groups), made only
    # when it is called; the result is then computed on the caller's routing
    from moetrain.kernels import grouped_gemm_tuning as tuning

    seen = []

    def fake_pick(key, candidates, config, run, run_skewed=None, peer=False):
        run_skewed(tuning.INTERPRETER_CONFIG)  # what the autotuner would time (it writes the output too)
        run(tuning.PEER)  # torch._grouped_mm's form of the op runs on the same operands (its result is dropped)
        run_skewed(tuning.PEER)
        seen.append((key[0], peer))
        return tuning.INTERPRETER_CONFIG

    from moetrain.runtime import timing

    made, real = [], timing.skewed_offs
    monkeypatch.setattr(timing, "skewed_offs",
                        lambda m, g, seed, device: made.append((m, g)) or real(m, g, seed, device))
    monkeypatch.setattr(gg, "pick_config", fake_pick)
    offs = [10, 10, 47, 60]
    x, w, dy, offs_t = make(offs, 70, 24, 16, seed=4)
    y = gg.grouped_gemm_fwd(x, w, offs_t, out=poisoned(70, 24))
    assert rel_err(y, gg.grouped_gemm_ref(x.double(), w.double(), offs_t)) < FP32_BOUND
    dw = gg.grouped_gemm_wgrad(dy, x, offs_t, out=poisoned(4, 24, 16))
    assert rel_err(dw, gg.grouped_gemm_wgrad_ref(dy.double(), x.double(), offs_t)) < FP32_BOUND
    # the peer is offered on CUDA tensors only (CPU tensors here: the interpreter's configs are fixed anyway)
    assert seen == [("fwd", False), ("wgrad", False)] and made == [(70, 4), (70, 4)]


def test_autotuner_times_its_finalists_again_and_takes_the_second_verdict(monkeypatch):
    # One short pass ranks every config; the FINALISTS fastest are timed again, longer, and that decides.
    from moetrain.kernels import grouped_gemm_tuning as tuning

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "_BEST", {})
    configs = [gg.GemmConfig(128, 256, 64, 3, 8), gg.GemmConfig(128, 128, 64, 4, 4), gg.GemmConfig(64, 128, 64, 4, 4),
               gg.GemmConfig(128, 128, 64, 4, 8)]
    first = dict(zip(configs, (1.0, 1.1, 1.2, 3.0)))  # the short pass: configs[0] looks best
    second = dict(zip(configs, (1.3, 1.05, 1.2, 0.5)))  # the long pass: configs[1] is; configs[3] is no finalist
    calls = []

    def fake_queued(run, reps, warmup):
        cfg = run()
        calls.append((cfg, reps))
        return (first if reps < tuning.FINAL_REPS else second)[cfg]

    monkeypatch.setattr(tuning, "queued_ms", fake_queued)
    assert tuning.pick_config(("fwd", "finalists"), tuple(configs), None, lambda cfg: cfg) == configs[1]
    retimed = {cfg for cfg, reps in calls if reps == tuning.FINAL_REPS}
    assert retimed == set(configs[:tuning.FINALISTS])
    assert len(calls) == len(configs) * tuning.TUNE_ROUNDS + tuning.FINALISTS * tuning.FINAL_ROUNDS


def test_tuned_configs_persist_on_disk_for_the_next_process(monkeypatch):
    from moetrain.runtime import disk_cache
    from moetrain.kernels import grouped_gemm_tuning as tuning

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "_BEST", {})
    monkeypatch.setattr(tuning, "queued_ms", lambda run, **kw: run())
    fast, slow = gg.GemmConfig(128, 128, 64, 4, 4), gg.GemmConfig(128, 256, 64, 3, 8)
    key = ("wgrad", torch.bfloat16, 4096, 7168, 256, True)
    assert tuning.pick_config(key, (slow, fast), None, {fast: 1.0, slow: 2.0}.get) == fast
    path = disk_cache.cache_dir() / tuning.CONFIG_CACHE_FILE
    assert tuning.disk_key(key) in path.read_text() and "bfloat16" in tuning.disk_key(key)

    def no_timing(*a, **kw):
        raise AssertionError("timed again despite the disk cache")

    monkeypatch.setattr(tuning, "_BEST", {})  # a new process: memory empty, the file read again
    monkeypatch.setattr(tuning, "_DISK", None)
    monkeypatch.setattr(tuning, "queued_ms", no_timing)
    assert tuning.pick_config(key, (slow, fast), None, None) == fast
    # a cached config that is no longer a candidate is timed again
    monkeypatch.setattr(tuning, "_BEST", {})
    monkeypatch.setattr(tuning, "queued_ms", lambda run, **kw: run())
    assert tuning.pick_config(key, (slow,), None, {slow: 2.0}.get) == slow


def test_host_integer_helpers_match_triton():
    import triton

    from moetrain.kernels.host import cdiv, next_pow2

    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 4095, 4096, 65537]:
        assert n == 0 or next_pow2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 64, 128, 256):
            assert cdiv(n, d) == triton.cdiv(n, d)


def test_in_turns_alternates_candidates_and_drops_failures():
    from moetrain.runtime.timing import in_turns

    calls, samples = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0])}

    def time_one(c):
        calls.append(c)
        if c == "b" and calls.count("b") == 2:
            raise RuntimeError("out of resources")
        return next(samples[c])

    medians, failed = in_turns(["a", "b"], time_one, rounds=3)
    assert calls == ["a", "b", "a", "b", "a"]
    assert medians == {"a": 2.0} and list(failed) == ["b"] and "out of resources" in str(failed["b"])


def test_in_turns_gives_every_candidate_each_place_in_a_round():
    # a GPU that heats up inside a round times its later places slower: equal candidates must come out equal
    from moetrain.runtime.timing import in_turns

    order = []

    def time_one(c):
        order.append(c)
        place = (len(order) - 1) % 3
        return 1.0 + 0.1 * place

    medians, _ = in_turns(["a", "b", "c"], time_one, rounds=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert medians == {"a": 1.1, "b": 1.1, "c": 1.1}


@pytest.mark.parametrize("text,most", [("7", 6), ("x", 5), ("", 5), ("1,4", 5)])
def test_kernel_scripts_refuse_bad_stages_in_one_line(text, most):
    from moetrain.kernels.sweep_grouped_gemm import script_stages

    with pytest.raises(SystemExit, match=rf"--stages: '{text}': each 2\.\.{most}"):
        script_stages(text, most)
    assert script_stages("5,4", 5) == [5, 4]
