"""Pipeline simulator: analytic bubbles, zero-bubble, uneven stages, timeline format."""

import json

import pytest

from moetrain.errors import ConfigError
from moetrain.plan.simulator import Op, order_1f1b, peak_in_flight, render_png, simulate


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


def test_interleaved_needs_multiple_of_pp():
    with pytest.raises(ConfigError, match="multiple of parallel.pp"):
        simulate("interleaved", 4, 2, 6, [1.0] * 8, [1.0] * 8)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16)])
def test_zero_bubble_h1_bubble(p, m):
    """ZB-H1 with F = B = W: the bubble shrinks from (p-1)(F+B+W) to (p-1)(F+B-W)."""
    zb = simulate("zero_bubble", p, 1, m, [1.0] * p, [1.0] * p, [1.0] * p)
    one = simulate("1f1b", p, 1, m, [1.0] * p, [1.0] * p, [1.0] * p)
    assert one.step_time == pytest.approx(3 * m + 3 * (p - 1))
    assert zb.step_time == pytest.approx(3 * m + (p - 1))
    # in flight never exceeds 1F1B's p - r
    for r, ops in enumerate(zb.ranks):
        live = peak = 0
        for op in ops:
            live += op.kind == "F"
            live -= op.kind == "B"
            peak = max(peak, live)
        assert peak <= p - r


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
    # one micro-batch: 4 forwards and 4 backwards in a chain with 3 + 3 cross-rank hops
    one = simulate("1f1b", 4, 1, 1, [1.0] * 4, [2.0] * 4, p2p_s=0.1)
    assert one.step_time == pytest.approx(4 * 3.0 + 6 * 0.1)
    many = simulate("1f1b", 4, 1, 8, [1.0] * 4, [2.0] * 4, p2p_s=0.1)
    assert many.step_time > simulate("1f1b", 4, 1, 8, [1.0] * 4, [2.0] * 4).step_time + 6 * 0.1 - 1e-9


def test_timeline_json_per_rank_per_micro_batch():
    tl = simulate("1f1b", 2, 1, 2, [1.0, 1.0], [2.0, 2.0])
    d = json.loads(tl.to_json())
    assert d["pp"] == 2 and d["micro_batches"] == 2 and d["step_time_s"] == 9.0
    ops = d["ranks"][1]["ops"]
    assert [(o["kind"], o["micro_batch"], o["start"], o["end"]) for o in ops] == [
        ("F", 0, 1.0, 2.0), ("B", 0, 2.0, 4.0), ("F", 1, 4.0, 5.0), ("B", 1, 5.0, 7.0)]
    assert d["ranks"][0]["bubble_fraction"] == pytest.approx(1 - 6 / 9)


def test_in_flight_memory_1f1b_and_zero_bubble():
    p, m = 4, 8
    acts = {s: 10.0 for s in range(p)}
    for r in range(p):
        assert peak_in_flight(order_1f1b(p, m, r), acts) == 10.0 * min(p - r, m)
    # zero-bubble: a B keeps the wgrad part until its W
    order = [Op("F", 0, 0, 0), Op("F", 1, 0, 0), Op("B", 0, 0, 0), Op("F", 2, 0, 0), Op("W", 0, 0, 0)]
    # F0 F1 -> 20; B0 frees 6 of 10 -> 14; F2 -> 24; W0 frees the last 4
    assert peak_in_flight(order, acts, {0: 4.0}) == 24.0


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    tl = simulate("zero_bubble", 3, 1, 4, [1.0] * 3, [1.0] * 3, [0.5] * 3)
    out = tmp_path / "t.png"
    render_png(tl, str(out))
    assert out.read_bytes()[:4] == b"\x89PNG"
