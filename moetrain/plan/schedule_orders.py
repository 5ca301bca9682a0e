"""Each pipeline rank's compute actions in the order torch.distributed.pipelining runs them.

``rank_steps(schedule, pp, vpp, micro_batches)`` builds torch's own schedule class for ``parallel.pp_schedule``
(1f1b: ``Schedule1F1B``, interleaved: ``ScheduleInterleaved1F1B``, zero_bubble: ``ScheduleZBVZeroBubble``,
dualpipev: ``ScheduleDualPipeV``) over stand-in stages that carry only the numbers a schedule reads while it plans
(no module, no process group), and reads its ``pipeline_order``. So the planner simulates the order the trainer
runs. Per rank: a list of steps, each a tuple of one ``Action``, or two for torch's OVERLAP_F_B (one micro-batch's
forward and another's backward issued together; forward first).

Action kinds (torch's letters): F forward, I input-gradient backward (its W follows later), W weight-gradient
backward, B whole backward (input and weight gradients in one op).

torch is imported here, lazily, and only for pp > 1: one rank runs its micro-batches one after the other, each
forward through its stages then backward. Orders are cached per (schedule, pp, vpp, micro_batches).
Relies only on what torch 2.11 and 2.13 both have: the four classes, ``pipeline_order``, ``_Action``,
``_ComputationType``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from moetrain.config.pipeline_layout import check_schedule
from moetrain.errors import UserError

CLASSES = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleZBVZeroBubble",
           "dualpipev": "ScheduleDualPipeV"}


class Action(NamedTuple):
    kind: str  # F, I, W or B (see the module doc)
    mb: int  # micro-batch
    stage: int  # global stage index


Step = tuple  # one Action, or (forward Action, backward Action) for an OVERLAP_F_B


def rank_steps(schedule: str, pp: int, vpp: int, micro_batches: int) -> tuple[tuple[Step, ...], ...]:
    """Per pipeline rank, its steps in execution order (see the module doc). ConfigError where torch cannot run
    the schedule with these degrees (``config.pipeline_layout.check_schedule``)."""
    check_schedule(schedule, pp, vpp, micro_batches)
    if pp == 1:
        return (_one_rank(vpp, micro_batches),)
    return _torch_steps(schedule, pp, vpp, micro_batches)


def rank_actions(schedule: str, pp: int, vpp: int, micro_batches: int) -> list[list[Action]]:
    """``rank_steps`` with every OVERLAP_F_B pair split into its forward, then its backward."""
    return [[a for step in steps for a in step] for steps in rank_steps(schedule, pp, vpp, micro_batches)]


def _one_rank(vpp: int, m: int) -> tuple[Step, ...]:
    steps = []
    for mb in range(m):
        steps += [(Action("F", mb, s),) for s in range(vpp)]
        steps += [(Action("B", mb, s),) for s in reversed(range(vpp))]
    return tuple(steps)


class _StandInStage:
    """What a schedule reads from its stages while it plans: the pipeline's size, this rank, the stage count.
    ``submod`` None: no module to inspect (the V schedules refuse compiled modules)."""

    def __init__(self, pp: int, n_stages: int, index: int):
        self.group_size = pp
        self.group_rank = 0
        self.num_stages = n_stages
        self.stage_index = index
        self.submod = None
        self.stage_index_to_group_rank = None


@lru_cache(maxsize=256)
def _torch_steps(schedule: str, pp: int, vpp: int, m: int) -> tuple[tuple[Step, ...], ...]:
    try:
        from torch.distributed.pipelining import schedules as ts
    except ImportError as err:
        raise UserError(f"the pipeline schedules come from torch.distributed.pipelining, which this torch cannot "
                        f"import ({err}); use a torch build with distributed support") from None
    cls = type("OrderOnly", (getattr(ts, CLASSES[schedule]),), {"_prepare_schedule_with_comms": _no_lowering})
    n_stages = pp * vpp
    if schedule == "1f1b":
        sched = cls(_StandInStage(pp, n_stages, 0), m)
    else:
        sched = cls([_StandInStage(pp, n_stages, c * pp) for c in range(vpp)], m)
    out, kinds = [], _kinds(ts)
    for rank in range(pp):
        steps = [_convert(a, ts, kinds) for a in sched.pipeline_order[rank] if a is not None and a.is_compute_op]
        out.append(tuple(steps))
    if schedule == "1f1b":
        out = [_renumber_forwards(steps) for steps in out]
    return tuple(out)


def _no_lowering(self, *args, **kwargs) -> None:
    """Stands in for the multi-stage schedules' lowering of ``pipeline_order`` to send / recv actions, which is not
    read here and takes time quadratic in the micro-batches (26 s for 1920 on torch 2.13). Where a torch version
    names it otherwise the lowering runs: slower, same order."""


def _kinds(ts) -> dict:
    return {ts._ComputationType.FORWARD: "F", ts._ComputationType.BACKWARD_INPUT: "I",
            ts._ComputationType.BACKWARD_WEIGHT: "W", ts._ComputationType.FULL_BACKWARD: "B"}


def _convert(action, ts, kinds: dict) -> Step:
    if action.computation_type == ts._ComputationType.OVERLAP_F_B:
        return tuple(Action(kinds[a.computation_type], a.microbatch_index, a.stage_index) for a in action.sub_actions)
    return (Action(kinds[action.computation_type], action.microbatch_index, action.stage_index),)


def _renumber_forwards(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """Schedule1F1B's ``pipeline_order`` (an outline beside its hand-written step loop, which the trainer runs)
    numbers the forwards of a rank without warm-up forwards 1..m instead of 0..m-1 (torch 2.11 to 2.13: the last
    rank). Its kinds are the loop's; each stage runs its forwards in micro-batch order, so the k-th forward is
    micro-batch k (a no-op where torch numbers them right)."""
    out, seen = [], {}
    for (a,) in steps:
        if a.kind == "F":
            a = a._replace(mb=seen.get(a.stage, 0))
            seen[a.stage] = a.mb + 1
        out.append((a,))
    return tuple(out)
