"""Pipeline simulator over torch's orders: analytic bubbles, ZB-V and DualPipe-V, dependencies, timeline format."""

import json

import pytest

from moetrain.config.pipeline_layout import stage_rank
from moetrain.errors import ConfigError
from moetrain.plan import schedule_orders
from moetrain.plan.schedule_orders import Action, rank_actions
from moetrain.plan.simulator import peak_in_flight, simulate

V_CASES = [("zero_bubble", 2, 4), ("zero_bubble", 4, 8), ("zero_bubble", 4, 9), ("dualpipev", 2, 4),
           ("dualpipev", 4, 8), ("dualpipev", 4, 11)]


@pytest.mark.parametrize("p, m", [(2, 3), (4, 4), (4, 8), (8, 16), (6, 7)])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (1.0, 1.0), (0.5, 1.7)])
def test_1f1b_bubble_formula(p, m, f, b):
    tl = simulate("1f1b", p, 1, m, [f] * p, [b] * p)
    assert tl.step_time == pytest.approx((m + p - 1) * (f + b))
    for r in range(p):
        assert tl.bubble_fraction(r) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 4), (8, 4, 16)])
def test_interleaved_bubble_formula(p, v, m):
    f, b = 1.0, 2.0  # per layer-group; each of the v chunks does 1/v of it
    tl = simulate("interleaved", p, v, m, [f / v] * (p * v), [b / v] * (p * v))
    for r in range(p):
        assert tl.bubble_fraction(r) == pytest.approx((p - 1) / (p - 1 + m * v))


def test_schedules_torch_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="rounds of parallel.pp = 2"):  # 7 micro-batches in 3 rounds
        simulate("interleaved", 2, 2, 7, [1.0] * 4, [1.0] * 4)
    with pytest.raises(ConfigError, match="at least 2 x parallel.pp = 8"):
        simulate("zero_bubble", 4, 2, 6, [1.0] * 8, [1.0] * 8)
    with pytest.raises(ConfigError, match="parallel.vpp=2"):
        simulate("dualpipev", 4, 1, 8, [1.0] * 4, [1.0] * 4)
    with pytest.raises(ConfigError, match="valid: 1f1b, interleaved, zero_bubble, dualpipev"):
        simulate("gpipe", 2, 1, 4, [1.0] * 2, [1.0] * 2)


def _ops_by_key(tl):
    out = {}
    for r, ops in enumerate(tl.ranks):
        for op in ops:
            assert (op.kind, op.mb, op.stage) not in out, f"{op} twice"
            out[(op.kind, op.mb, op.stage)] = (r, op)
    return out


@pytest.mark.parametrize("schedule, p, m", V_CASES)
def test_v_schedules_run_every_op_once_in_dependency_order(schedule, p, m):
    n, hop = 2 * p, 0.05
    f = [0.3 + 0.1 * s for s in range(n)]  # uneven stages
    b, w = [2 * x for x in f], [0.7 * x for x in f]
    tl = simulate(schedule, p, 2, m, f, b, w, p2p_s=hop)
    ops = _ops_by_key(tl)
    for s in range(n):
        for mb in range(m):
            r, fwd = ops[("F", mb, s)]
            _, bwd = ops[("B", mb, s)]
            assert r == stage_rank(s, p, schedule) and fwd.chunk == s // p
            assert fwd.end - fwd.start == pytest.approx(f[s])
            # the weight gradient is its own op (cost b) or part of a whole backward (b + w)
            split = ("W", mb, s) in ops
            assert bwd.end - bwd.start == pytest.approx(b[s] if split else b[s] + w[s])
            if split:
                assert ops[("W", mb, s)][1].start >= bwd.end - 1e-12
                assert ops[("W", mb, s)][1].end - ops[("W", mb, s)][1].start == pytest.approx(w[s])
            if s > 0:
                r_prev, prev = ops[("F", mb, s - 1)]
                assert fwd.start >= prev.end + (hop if r_prev != r else 0.0) - 1e-12
            r_next, nxt = ops[("B", mb, s + 1)] if s < n - 1 else ops[("F", mb, s)]
            assert bwd.start >= nxt.end + (hop if r_next != r else 0.0) - 1e-12
    assert len(ops) == sum(len(o) for o in tl.ranks)
    if schedule == "zero_bubble":
        assert all(("W", mb, s) in ops for s in range(n) for mb in range(m))  # ZB-V defers every weight gradient
    for ops_r in tl.ranks:  # one op at a time per rank
        assert all(a.end <= b_.start + 1e-12 for a, b_ in zip(ops_r, ops_r[1:]))


@pytest.mark.parametrize("schedule, p, m", V_CASES)
def test_v_schedules_deterministic(schedule, p, m):
    times = ([0.5] * 2 * p, [0.6] * 2 * p, [0.4] * 2 * p)
    first = simulate(schedule, p, 2, m, *times, p2p_s=0.01).to_dict()
    schedule_orders._torch_steps.cache_clear()  # the orders built again from torch's classes
    assert simulate(schedule, p, 2, m, *times, p2p_s=0.01).to_dict() == first


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 9), (8, 16)])
def test_zero_bubble_and_dualpipev_against_1f1b(p, m):
    """Uniform stages, f = b = w, the same model split in p (1F1B) or 2p (V) stages. Every rank holds 2m stage-steps
    of f + b + w, and the last rank waits (p - 1) stage forwards for the first micro-batch: ZB-V fills every other
    gap with weight gradients and reaches that bound; 1F1B idles (p - 1)(F + B + W)."""
    one = simulate("1f1b", p, 1, m, [1.0] * p, [1.0] * p, [1.0] * p)
    zb = simulate("zero_bubble", p, 2, m, [0.5] * 2 * p, [0.5] * 2 * p, [0.5] * 2 * p)
    dv = simulate("dualpipev", p, 2, m, [0.5] * 2 * p, [0.5] * 2 * p, [0.5] * 2 * p)
    bound = 2 * m * 1.5 + (p - 1) * 0.5
    assert one.step_time == pytest.approx(3 * m + 3 * (p - 1))
    assert zb.step_time == pytest.approx(bound)
    assert bound - 1e-9 <= dv.step_time <= one.step_time


def test_uneven_stages_slowest_sets_pace():
    f = [1.0, 1.0, 3.0, 1.0]
    b = [2.0, 2.0, 6.0, 2.0]
    m = 8
    tl = simulate("1f1b", 4, 1, m, f, b)
    # the slow stage is busy m * 9 and the others wait for it: the step is at least that
    assert tl.busy(2) == pytest.approx(m * 9)
    assert tl.step_time >= m * 9
    assert tl.bubble_fraction(2) < tl.bubble_fraction(0)


def test_p2p_latency_on_the_critical_path():
    # p = 2, m = 2, f = 1, b = 2, hop 0.1: rank 0 F0 [0, 1] F1 [1, 2]; rank 1 F0 [1.1, 2.1] B0 [2.1, 4.1] F1 [4.1, 5.1]
    # B1 [5.1, 7.1]; rank 0 B0 [4.2, 6.2] B1 [7.2, 9.2]: one hop each way on the critical path
    tl = simulate("1f1b", 2, 1, 2, [1.0] * 2, [2.0] * 2, p2p_s=0.1)
    assert tl.step_time == pytest.approx(9.2)
    assert [(op.kind, op.mb) for op in tl.ranks[0]] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert [op.start for op in tl.ranks[0]] == pytest.approx([0.0, 1.0, 4.2, 7.2])
    many = simulate("1f1b", 4, 1, 8, [1.0] * 4, [2.0] * 4, p2p_s=0.1)
    assert many.step_time > simulate("1f1b", 4, 1, 8, [1.0] * 4, [2.0] * 4).step_time + 6 * 0.1 - 1e-9


def test_timeline_json_per_rank_per_micro_batch():
    tl = simulate("1f1b", 2, 1, 2, [1.0, 1.0], [2.0, 2.0])
    d = json.loads(tl.to_json())
    assert d["source"] == "simulated" and d["pp"] == 2 and d["micro_batches"] == 2 and d["step_time_s"] == 9.0
    ops = d["ranks"][1]["ops"]
    assert [(o["kind"], o["micro_batch"], o["start"], o["end"]) for o in ops] == [
        ("F", 0, 1.0, 2.0), ("B", 0, 2.0, 4.0), ("F", 1, 4.0, 5.0), ("B", 1, 5.0, 7.0)]
    assert d["ranks"][0]["bubble_fraction"] == pytest.approx(1 - 6 / 9)
    assert d["ranks"][0]["peak_mem_gib"] is None
    assert tl.orders()[1] == [("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1)]


def test_in_flight_memory_follows_torch_orders():
    p, m = 4, 8
    acts = {s: 10.0 for s in range(2 * p)}
    for r, order in enumerate(rank_actions("1f1b", p, 1, m)):
        assert peak_in_flight(order, acts) == 10.0 * min(p - r, m)
    # ZB-V at p = 2, m = 4, rank 0 (stages 0 and 3): F0.0 F0.1 F0.2 F3.0 -> 40; I3.0 keeps the 4 of wgrad (34), W3.0
    # frees it (30); F3.1 40, I W 30; F0.3 40; ... the peak is 4 stage-micro-batches
    zbv = rank_actions("zero_bubble", 2, 2, 4)[0]
    assert [(a.kind, a.stage, a.mb) for a in zbv[:6]] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 3, 0),
                                                          ("I", 3, 0), ("W", 3, 0)]
    assert peak_in_flight(zbv, acts, {s: 4.0 for s in acts}) == 40.0
    assert peak_in_flight(zbv[:5], acts, {s: 4.0 for s in acts}) == 40.0
    # an input-gradient backward keeps the weight-gradient part until its W: F0.3 between I3.0 and W3.0 -> 34 + 10
    order = zbv[:5] + [Action("F", 3, 0), zbv[5]]
    assert peak_in_flight(order, acts, {s: 4.0 for s in acts}) == 44.0
    # a whole backward (no W follows) frees everything: 30 + 10
    assert peak_in_flight(zbv[:5] + [Action("F", 3, 0)], acts, {s: 4.0 for s in acts}) == 40.0
