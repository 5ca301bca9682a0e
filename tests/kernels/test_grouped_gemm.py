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
    import sys

    ops_gemm = sys.modules["moetrain.ops.grouped_gemm"]  # (the package's name grouped_gemm is the function)
    monkeypatch.setattr(ops_gemm, "triton_available", lambda: False)  # as without the package
    with pytest.raises(UserError, match="triton package"):
        ops.resolve_backend("triton", torch.device(DEVICE))


def test_ops_import_does_not_import_triton():
    code = "import sys, moetrain.ops; assert 'triton' not in sys.modules, 'moetrain.ops imported triton'"
    script_result(code)  # fails the test unless the script exits 0


def test_launchers_tune_on_the_callers_and_a_skewed_routing_of_the_same_rows():
    # _tuned hands the tuner two runs: the caller's routing and runtime.timing.skewed_offs of the same rows and
    # groups (made once, only when timed); with torch first among the candidates it is the peer of kind "+torch"
    from moetrain import tuning

    seen = []
    x, w, dy, offs_t = make([10, 10, 47, 60], 70, 24, 16, seed=4)

    def run_with(cand, routing):
        seen.append((cand, routing))
        return 1.0 if cand == gg.TORCH else 2.0

    timer = lambda run, reps: run()  # noqa: E731 (the run returns its fake time)
    with tuning.use(tuning.Tuner(timer=timer)) as tuner:
        cands = (gg.TORCH, gg.INTERPRETER_CONFIG)
        assert gg._tuned("fwd", x, 70, 4, 24, 16, (True, False), cands, run_with, offs_t) == gg.TORCH
    (decision,) = tuner.decisions
    assert decision.key.startswith("gemm_fwd+torch|float32|N24|K16|b32|True,False|cpu|")
    routings = {id(r) for _, r in seen}
    assert len(routings) == 2  # the caller's offs and one skewed routing, made once
    skewed = next(r for _, r in seen if r is not offs_t)
    assert int(skewed[-1]) == 70 and skewed.shape == (4,) and not torch.equal(skewed, offs_t)


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
