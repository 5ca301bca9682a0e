"""Discrete-event simulator of the pipeline schedules torch runs: 1f1b, interleaved, zero_bubble (ZB-V), dualpipev.

Orders: each rank's compute actions come from torch's own schedule definitions (``schedule_orders.rank_steps``),
so planner and trainer run the same order; stage s sits on rank ``config.pipeline_layout.stage_rank(s, p,
schedule)`` (looped, or V for zero_bubble and dualpipev).

Timing: p ranks, v stages per rank, m micro-batches; stage s has a forward time f[s], an input-gradient time b[s]
and a weight-gradient time w[s]. An op costs f (F), b (I: input gradient, a W follows), w (W) or b + w (B: the whole
backward, as 1f1b and interleaved run it). A rank runs its steps in order, each as soon as the rank is free and its
inputs are there: F of stage s after F of stage s-1 (same micro-batch), a backward of s after the backward of s+1
(of the last stage: after its F), W after the backward of its stage and micro-batch; an input from another rank
arrives ``p2p_s`` later. An OVERLAP_F_B step (dualpipev: one micro-batch's forward with another's backward) costs
f + the backward of its two parts: it is modelled as the two run one after the other, their results leaving when
both are done (torch sends them after the step); what overlapping them gains is a later measurement.

For uniform stages without communication the simulator reproduces the analytic bubbles: 1F1B (p-1)/(m+p-1) and
interleaved (p-1)/(p-1+m v) of the step (tests/plan/test_simulator.py). ``peak_in_flight`` walks a rank's order
for the activation memory it keeps. Pure Python (the orders import torch, see schedule_orders.py).
"""

from __future__ import annotations

from moetrain.config.pipeline_layout import stage_rank
from moetrain.plan.schedule_orders import Action, rank_steps
from moetrain.plan.timeline import Op, Timeline

DONE_KIND = {"F": "F", "I": "B", "B": "B", "W": "W"}  # an input-gradient or whole backward both unblock stage s-1


def _deps(a: Action, n_stages: int) -> list[tuple[str, int, int]]:
    if a.kind == "F":
        return [("F", a.mb, a.stage - 1)] if a.stage > 0 else []
    if a.kind in ("I", "B"):
        return [("B", a.mb, a.stage + 1)] if a.stage < n_stages - 1 else [("F", a.mb, a.stage)]
    return [("B", a.mb, a.stage)]


def _ready(step: tuple, rank: int, done: dict, n_stages: int, rank_of: list[int], p2p: float) -> float | None:
    """When the step's inputs are all on ``rank``, or None while one is not computed yet."""
    t = 0.0
    for a in step:
        for kind, mb, stage in _deps(a, n_stages):
            end = done.get((kind, mb, stage))
            if end is None:
                return None
            t = max(t, end + (p2p if rank_of[stage] != rank else 0.0))
    return t


def simulate(schedule: str, p: int, v: int, m: int, f: list[float], b: list[float], w: list[float] | None = None,
             p2p_s: float = 0.0) -> Timeline:
    """Run torch's order for ``schedule``; f, b, w are per-stage times (len p * v). ConfigError where torch cannot
    run the schedule with these degrees (``config.pipeline_layout.check_schedule``)."""
    n = p * v
    w = w or [0.0] * n
    if not (len(f) == len(b) == len(w) == n):
        raise ValueError(f"need {n} stage times, got {len(f)}, {len(b)}, {len(w)}")
    steps = rank_steps(schedule, p, v, m)
    rank_of = [stage_rank(s, p, schedule) for s in range(n)]
    cost = {"F": f, "I": b, "W": w, "B": [b[s] + w[s] for s in range(n)]}
    done: dict[tuple[str, int, int], float] = {}
    ops: list[list[Op]] = [[] for _ in range(p)]
    free = [0.0] * p
    nxt = [0] * p
    remaining = sum(len(s) for s in steps)
    while remaining:
        progress = False
        for r in range(p):
            while nxt[r] < len(steps[r]):
                step = steps[r][nxt[r]]
                ready = _ready(step, r, done, n, rank_of, p2p_s)
                if ready is None:
                    break
                t = max(free[r], ready)
                for a in step:
                    ops[r].append(Op(DONE_KIND[a.kind], a.mb, a.stage // p, a.stage, t, t + cost[a.kind][a.stage]))
                    t = ops[r][-1].end
                for a in step:
                    done[(DONE_KIND[a.kind], a.mb, a.stage)] = t
                free[r] = t
                nxt[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (p={p}, v={v}, m={m})")
    return Timeline(schedule, p, v, m, ops, step_time=max(free) if free else 0.0, source="simulated")


# ---- memory in flight -------------------------------------------------------------------------------------------

def peak_in_flight(order: list, act: dict[int, float], wgrad: dict[int, float] | None = None) -> float:
    """Peak saved-activation bytes on one rank walking its ops in order (anything with ``kind``, ``mb``,
    ``stage``: schedule_orders.Action or timeline.Op). F adds the stage's activations; a backward frees them,
    keeping the weight-gradient part (``wgrad``) where a W of the same stage and micro-batch follows; W frees that."""
    return peak_of_states(in_flight_states(order), act, wgrad)


def in_flight_states(order: list) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The distinct states a rank's order passes through right after each forward (where the saved activations
    peak), each as ((stage, micro-batches whose activations are kept, micro-batches whose weight-gradient part
    alone is kept), ...) by stage. A long order repeats few states: the peak over them is that of the walk."""
    deferred = {(op.stage, op.mb) for op in order if op.kind == "W"}
    kept: dict[int, int] = {}
    wgrad_only: dict[int, int] = {}
    seen: dict[tuple, None] = {}
    for op in order:
        if op.kind == "F":
            kept[op.stage] = kept.get(op.stage, 0) + 1
            state = tuple((s, kept.get(s, 0), wgrad_only.get(s, 0)) for s in sorted(set(kept) | set(wgrad_only)))
            seen.setdefault(state, None)
        elif op.kind in ("I", "B"):
            kept[op.stage] -= 1
            if (op.stage, op.mb) in deferred:
                wgrad_only[op.stage] = wgrad_only.get(op.stage, 0) + 1
        else:
            wgrad_only[op.stage] -= 1
    return tuple(seen)


def peak_of_states(states, act: dict[int, float], wgrad: dict[int, float] | None = None) -> float:
    """The peak saved bytes over ``in_flight_states``."""
    wgrad = wgrad or {}
    return max((sum(n * act[s] + k * wgrad.get(s, 0.0) for s, n, k in st) for st in states), default=0.0)
