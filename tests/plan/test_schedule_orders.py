"""Per-rank compute orders read from torch's schedule classes: counts, placement, every op once, known sequences."""

from collections import Counter

import pytest

from moetrain.config.pipeline_layout import check_schedule, stage_rank
from moetrain.errors import ConfigError
from moetrain.plan.memory import rank_states, steady_micro_batches
from moetrain.plan.schedule_orders import rank_actions, rank_steps
from moetrain.plan.simulator import in_flight_states

CASES = [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("schedule, vpp", CASES)
@pytest.mark.parametrize("pp, m", [(2, 4), (2, 6), (4, 8), (4, 12)])
def test_every_stage_runs_every_micro_batch_once_on_its_rank(schedule, vpp, pp, m):
    orders = rank_actions(schedule, pp, vpp, m)
    assert len(orders) == pp
    seen = Counter()
    for r, order in enumerate(orders):
        assert {a.stage for a in order} == {s for s in range(pp * vpp) if stage_rank(s, pp, schedule) == r}
        seen.update((a.kind, a.stage, a.mb) for a in order)
    assert set(seen.values()) == {1}
    for s in range(pp * vpp):
        for mb in range(m):
            assert seen[("F", s, mb)] == 1
            # one whole backward, or an input-gradient backward before its weight gradient
            assert seen[("B", s, mb)] + seen[("I", s, mb)] == 1
            assert seen[("W", s, mb)] == seen[("I", s, mb)]
    if schedule in ("1f1b", "interleaved"):
        assert all(a.kind in "FB" for order in orders for a in order)
    if schedule == "zero_bubble":
        assert all(a.kind in "FIW" for order in orders for a in order)
    # each rank runs the per-stage ops in micro-batch order and a W after its I
    for order in orders:
        for kind in "FBIW":
            for s in {a.stage for a in order}:
                mbs = [a.mb for a in order if a.kind == kind and a.stage == s]
                assert mbs == sorted(mbs)
        pos = {(a.kind, a.stage, a.mb): i for i, a in enumerate(order)}
        assert all(pos[("I", s, mb)] < i for (k, s, mb), i in pos.items() if k == "W")


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 5)])
def test_1f1b_is_warm_up_then_one_forward_one_backward(pp, m):
    """Schedule1F1B's step loop: p - r - 1 warm-up forwards, then F/B pairs, then the remaining backwards (also on
    the last rank, whose forwards torch's pipeline_order numbers from 1)."""
    for r, order in enumerate(rank_actions("1f1b", pp, 1, m)):
        warm = pp - r - 1
        want = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            want += [("F", warm + i), ("B", i)]
        want += [("B", i) for i in range(m - warm, m)]
        assert [(a.kind, a.mb) for a in order] == want


def test_interleaved_warm_up_is_megatrons():
    pp, v, m = 4, 2, 8
    for r, order in enumerate(rank_actions("interleaved", pp, v, m)):
        first_b = next(i for i, a in enumerate(order) if a.kind == "B")
        assert first_b == (pp - r - 1) * 2 + (v - 1) * pp + 1  # warm-up forwards, then one more forward
        assert [a.stage for a in order[:pp]] == [r] * pp  # a round of pp micro-batches on chunk 0 first


def test_dualpipev_overlap_pairs():
    pp, m = 4, 8
    steps = rank_steps("dualpipev", pp, 2, m)
    for r, rank in enumerate(steps):
        pairs = [s for s in rank if len(s) == 2]
        assert pairs, f"rank {r} has no OVERLAP_F_B"
        for fwd, bwd in pairs:
            assert fwd.kind == "F" and bwd.kind == "B"
            assert {fwd.stage, bwd.stage} == {r, 2 * pp - 1 - r}  # its two stages, one forward, one backward
    # the pairs split into rank_actions: forward first, then the backward
    flat = rank_actions("dualpipev", pp, 2, m)
    assert [len(a) for a in flat] == [sum(len(s) for s in rank) for rank in steps]


def test_one_rank_needs_no_torch_schedule():
    (order,) = rank_actions("1f1b", 1, 2, 2)
    assert [(a.kind, a.stage, a.mb) for a in order] == [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0),
                                                        ("F", 0, 1), ("F", 1, 1), ("B", 1, 1), ("B", 0, 1)]


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zero_bubble", 2),
                                          ("dualpipev", 2)])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_a_shortened_walk_passes_the_same_in_flight_states(schedule, vpp, pp):
    # memory.rank_states walks steady_micro_batches(m) micro-batches instead of m: the distinct states must agree
    shortened = 0
    for m in range(1, 5 * pp + 2):
        try:
            check_schedule(schedule, pp, vpp, m)
        except ConfigError:
            continue
        short = steady_micro_batches(schedule, pp, m)
        shortened += short < m
        full = tuple(in_flight_states(order) for order in rank_actions(schedule, pp, vpp, m))
        assert rank_states(schedule, pp, vpp, m) == full, (m, short)
    assert shortened > 0
