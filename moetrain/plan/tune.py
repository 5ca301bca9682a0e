"""`moetrain plan tune`: search parallel layouts, schedules, recompute and precision for the fastest step that fits.

The search is best-first over three kinds of items, each keyed by a lower bound of the step time of everything it
stands for (so the first K complete candidates popped are the K fastest of the space, as an exhaustive search over
the same space would rank them):

1. a shape (``tune_space``: degrees, micro-batch, optimizer precision), keyed by ``StageCosts.time_bound`` (the
   whole model's work over pp plus an average rank's tail); shapes whose memory bound does not fit are dropped;
2. a pipeline option of a shape (schedule, vpp, layout from ``tune_layouts``, recompute base none or selective),
   keyed by its busiest rank's work in the base mode plus the largest tail (recompute only adds work);
3. the same with its recompute ids chosen (``tune_recompute``: per rank, from its own headroom), keyed by its
   busiest rank's real work plus the largest tail; popping it runs the pipeline simulator (torch's order), whose
   makespan plus the largest tail is the projected step: that of ``project_perf`` (``tune_costs`` composes the
   same stage times).

The search stops when the next bound is no better than the K-th best step found. Everything is ordered
(sorted shapes, keys with a sequence number), so the same inputs give the same candidates. The projection core:
no torch but the schedule orders (``schedule_orders``), neither train nor kernels.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

from moetrain.config.schema import Config, ConfigError
from moetrain.plan import comm
from moetrain.plan.layout import parse_layout
from moetrain.plan.memory import AT_RISK, CONTEXT_GIB, NCCL_GIB, GiB
from moetrain.plan.simulator import simulate
from moetrain.plan.tune_costs import Params, StageCosts, Work
from moetrain.plan.tune_layouts import layouts
from moetrain.plan.tune_recompute import RecomputeChoice, choose
from moetrain.plan.tune_space import Shape, Space, agrees, derive, pipelines, shape_config, shapes

BASES = ("none", "selective")


@dataclass
class Options:
    top_k: int = 5
    attention: str = "auto"
    moe_imbalance: float = 1.0
    dp_overlap: float = 0.5
    exhaustive: bool = False  # evaluate every option of every shape (tests: the pruned search must agree)


@dataclass
class Found:
    """One evaluated candidate: the search's own numbers (``tune_report`` adds the official projection)."""

    overrides: dict
    shape: Shape
    schedule: str
    vpp: int
    layout: str | None
    recompute: RecomputeChoice
    step_time_s: float
    makespan_s: float
    tail_s: float
    busy_s: float  # the busiest rank's compute (recompute included)
    recompute_s: float  # of busy_s: the recomputed forwards on that rank
    comm_s: float  # tensor/expert-parallel communication inside the busiest rank's work

    @property
    def peak_mem_gib(self) -> float:
        return self.recompute.memory.peak_gib


@dataclass
class Stats:
    shapes: int = 0
    refused: int = 0  # by Config.check
    memory_pruned: int = 0  # memory bound above the fits limit
    options: int = 0  # pipeline options built
    memory_pruned_options: int = 0  # a rank's memory bound above the fits limit
    recompute_searches: int = 0
    infeasible: int = 0  # no recompute choice fits
    simulated: int = 0
    memory_projections: int = 0
    seconds: float = 0.0
    stop_bound_s: float | None = None  # the first bound left unexplored (>= the K-th best step)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TuneResult:
    found: list[Found]  # best first, at most top_k
    stats: Stats
    limit_gib: float  # the fits limit on the first-step peak with fragmentation
    notes: list[str] = field(default_factory=list)


def fits_limit_gib(hw, gpus: int) -> float:
    return AT_RISK * (hw.hbm_gib - CONTEXT_GIB - (NCCL_GIB if gpus > 1 else 0.0))


class _Search:
    def __init__(self, base: Config, hw, space: Space, opts: Options, progress: Callable[[str], None] | None):
        self.base, self.hw, self.space, self.opts = base, hw, space, opts
        self.progress = progress or (lambda msg: None)
        self.stats = Stats()
        self.limit = fits_limit_gib(hw, space.gpus) * GiB
        self.heap: list = []
        self.seq = 0
        self.best: list[Found] = []
        self.seen: set = set()
        self.tables: dict = {}  # cost tables shared by shapes with the same per-block work
        self.started = time.perf_counter()
        self.last_note = self.started

    # ---- queue -------------------------------------------------------------------------------------------------

    def push(self, key: float, kind: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (key, self.seq, kind, payload))

    def kth(self) -> float:
        return self.best[self.opts.top_k - 1].step_time_s if len(self.best) >= self.opts.top_k else float("inf")

    def keep(self, f: Found) -> None:
        self.best.append(f)
        self.best.sort(key=lambda x: (x.step_time_s, x.shape, x.schedule, x.vpp, x.layout or "", x.recompute.base))
        del self.best[self.opts.top_k:]

    def note(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last_note < 2.0:
            return
        self.last_note = now
        s = self.stats
        best = f"best {self.best[0].step_time_s:.3f} s ({self.best[0].shape.describe()})" if self.best else "none yet"
        self.progress(f"tune: [{now - self.started:.1f} s] {s.options} pipeline options, {s.recompute_searches} "
                      f"recompute searches, {s.simulated} simulated; {best}")

    # ---- the three kinds ---------------------------------------------------------------------------------------

    def costs_for(self, cfg: Config, shape: Shape) -> StageCosts:
        key = (shape.tp, shape.cp, shape.ep, shape.etp, shape.mbs, shape.optim)
        tables = self.tables.setdefault(key, {})
        return StageCosts(cfg, self.hw, self.opts.attention, self.opts.moe_imbalance, tables=tables)

    def add_shapes(self) -> None:
        all_shapes = shapes(self.base, self.space)
        self.stats.shapes = len(all_shapes)
        for shape in all_shapes:
            cfg = shape_config(self.base, shape, self.space.global_batch)
            if cfg is None:
                self.stats.refused += 1
                continue
            costs = self.costs_for(cfg, shape)
            if not self.opts.exhaustive and costs.memory_bound(shape.pp) > self.limit:
                self.stats.memory_pruned += 1
                continue
            self.push(costs.time_bound(shape.pp, self.opts.dp_overlap), "shape", (shape, cfg, costs))
        self.progress(f"tune: {self.stats.shapes} shapes ({self.stats.refused} refused by the config checks, "
                      f"{self.stats.memory_pruned} above the memory bound), {len(self.heap)} to search")

    def expand(self, shape: Shape, cfg: Config, costs: StageCosts) -> None:
        m = cfg.grad_accum_steps
        L, D = cfg.model.num_layers, cfg.model.mtp_num_layers
        items = _item_costs(costs)
        for schedule, vpp in pipelines(shape.pp, L + D, m, self.space.max_vpp):
            texts = layouts(items, L, D, shape.pp * vpp) if shape.pp > 1 else [None]
            for text in texts:
                for base in BASES:
                    over = dict(shape.overrides(self.space.global_batch))
                    over.update({"parallel.pp_schedule": schedule, "parallel.vpp": vpp,
                                 "parallel.pipeline_layout": text, "train.recompute": base})
                    if not agrees(over, self.space.fixed):
                        continue
                    try:
                        combo = derive(cfg, {**over, "train.recompute_layer_ids": None})
                    except ConfigError:
                        continue
                    self.stats.options += 1
                    if not self.opts.exhaustive and not _fits_bound(combo, costs, self.limit):
                        self.stats.memory_pruned_options += 1
                        continue
                    key = _bound(combo, costs, lambda g, b=base: b, self.opts.dp_overlap)[0]
                    self.push(key, "option", (shape, combo, costs, base))

    def recompute(self, shape: Shape, combo: Config, costs: StageCosts, base: str) -> None:
        self.stats.recompute_searches += 1
        choice = choose(combo, self.hw, base, self.opts.attention, self.opts.moe_imbalance)
        self.stats.memory_projections += choice.projections if choice else 2
        if choice is None:
            self.stats.infeasible += 1
            return
        over = _overrides(combo, choice)
        ident = tuple(sorted((k, repr(v)) for k, v in over.items()))
        if ident in self.seen:  # none and selective both ended at recompute=full
            return
        self.seen.add(ident)
        cfg = derive(combo, choice.overrides())
        key, works, tails = _bound(cfg, costs, choice.mode_of, self.opts.dp_overlap)
        self.push(key, "ready", (shape, cfg, costs, choice, over, works, tails))

    def finish(self, shape, cfg, costs, choice, over, works, tails) -> None:
        self.stats.simulated += 1
        layout, m = parse_layout(cfg), cfg.grad_accum_steps
        p2p = _p2p_seconds(cfg, costs, self.hw) if layout.pp > 1 else 0.0
        schedule = cfg.parallel.pp_schedule if layout.pp > 1 else "1f1b"
        tl = simulate(schedule, layout.pp, layout.vpp, m, [w.f for w in works], [w.b for w in works],
                      [w.w for w in works], p2p)
        busy = [m * sum(works[s.index].total for s in layout.stages_of_rank(r)) for r in range(layout.pp)]
        r_max = max(range(layout.pp), key=lambda r: busy[r])
        stages = layout.stages_of_rank(r_max)
        none = [costs.stage_work(s, lambda g: "none") for s in stages]
        recomputed = m * (sum(works[s.index].total for s in stages) - sum(w.total for w in none))
        comm_s = m * sum(works[s.index].comm for s in stages)
        self.keep(Found(over, shape, cfg.parallel.pp_schedule, cfg.parallel.vpp, cfg.parallel.pipeline_layout, choice,
                        tl.step_time + max(tails), tl.step_time, max(tails), busy[r_max], recomputed, comm_s))

    # ---- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> TuneResult:
        self.add_shapes()
        while self.heap:
            key, _, kind, payload = heapq.heappop(self.heap)
            if not self.opts.exhaustive and key >= self.kth():
                self.stats.stop_bound_s = key
                break
            step = {"shape": self.expand, "option": self.recompute, "ready": self.finish}[kind]
            step(*payload)
            self.note()
        self.stats.seconds = time.perf_counter() - self.started
        self.note(force=True)
        return TuneResult(self.best, self.stats, self.limit / GiB)


def _item_costs(costs: StageCosts) -> dict[str, float]:
    """f + b + w per micro-batch of the layout items (``tune_layouts``), without recompute."""
    L, D = costs.L, costs.D
    out = {f"t{i}": costs.block(i, "none").total for i in range(L)}
    none = ("none",) * D
    out.update(E=costs.rest(True, (), False).total, L=costs.rest(False, (), True).total,
               ML=costs.rest(False, none, True).total, M=costs.rest(False, none, False).total if D else 0.0)
    return out


def _rank_params(costs: StageCosts, layout) -> list[Params]:
    """Each pipeline rank's local parameters (cached per layout and placement)."""
    key = ("ranks", layout.text, tuple(st.rank for st in layout.stages))
    if key not in costs.memo:
        out = []
        for r in range(layout.pp):
            total = Params()
            for st in layout.stages_of_rank(r):
                total = total + costs.stage_params(st)
            out.append(total)
        costs.memo[key] = out
    return costs.memo[key]


def _bound(cfg: Config, costs: StageCosts, mode_of, dp_overlap: float) -> tuple[float, list[Work], list[float]]:
    """(the busiest rank's work + the largest tail, each stage's work, each rank's tail) for ``cfg``'s layout with
    each block in ``mode_of(gid)``."""
    layout, m = parse_layout(cfg), cfg.grad_accum_steps
    works = [costs.stage_work(st, mode_of) for st in layout.stages]
    busy = [m * sum(works[s.index].total for s in layout.stages_of_rank(r)) for r in range(layout.pp)]
    tails = [costs.tail(p.dense, p.expert, p.blocks, dp_overlap) for p in _rank_params(costs, layout)]
    return max(busy) + max(tails), works, tails


def _fits_bound(cfg: Config, costs: StageCosts, limit: float) -> bool:
    """Whether every rank's memory bound is within the fits limit. Saved activations: a rank keeps at least one
    micro-batch of each of its stages at once (all its forwards of micro-batch 0 come before the first of its
    backwards), and rank r at least min(pp - r, micro-batches) of its first stage (stage r) at once under each of
    torch's schedules (tests/plan/test_tune.py checks it on their orders); each kept block at least its input. On top,
    the first moment of its backward: the loss gradients, or its last block's activations and working set, and FSDP's
    gradients of its largest block."""
    layout, L, m = parse_layout(cfg), cfg.model.num_layers, cfg.grad_accum_steps
    for r, p in enumerate(_rank_params(costs, layout)):
        stages = layout.stages_of_rank(r)
        one = sum(len(st.block_ids(L)) for st in stages) * costs.block_input
        first = min(layout.pp - r, m) * len(layout.stages[r].block_ids(L)) * costs.block_input
        last = stages[-1].block_ids(L)
        moment = costs.block_transient(last[-1]) if last else 0.0
        if any(st.has_loss or st.mtp for st in stages):
            moment = max(moment, costs.loss_transient())
        ids = [g for st in stages for g in st.block_ids(L)]
        moment += costs.gathered_gradients(max((costs.block_params(g) for g in ids), default=0.0))
        if costs.rank_memory_bound(p.dense, p.expert, max(one, first) + moment) > limit:
            return False
    return True


def _p2p_seconds(cfg: Config, costs: StageCosts, hw) -> float:
    from moetrain.distributed.layout import RankLayout

    link = comm.group_link(hw, 2, RankLayout.from_config(cfg.parallel).stride("pp"))
    return comm.p2p(costs.d.b * costs.d.Th * cfg.model.hidden_size, link)


def _overrides(cfg: Config, choice: RecomputeChoice) -> dict:
    """Every key the tuner sets, as ``moetrain train`` / ``plan memory|perf`` take them."""
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    out = {"parallel.tp": p.tp, "parallel.sequence_parallel": p.sequence_parallel, "parallel.cp": p.cp,
           "parallel.pp": p.pp, "parallel.vpp": p.vpp, "parallel.pp_schedule": p.pp_schedule,
           "parallel.pipeline_layout": p.pipeline_layout, "parallel.dp": p.dp, "parallel.dp_replicate": p.dp_replicate,
           "parallel.ep": p.ep, "parallel.etp": p.etp, "train.micro_batch_size": t.micro_batch_size,
           "train.global_batch_size": t.global_batch_size, "precision.master_weights": cfg.precision.master_weights,
           "optim.main_grads_dtype": o.main_grads_dtype, "optim.exp_avg_dtype": o.exp_avg_dtype,
           "optim.exp_avg_sq_dtype": o.exp_avg_sq_dtype}
    out.update(choice.overrides())
    return out


def tune(base: Config, hw, space: Space, opts: Options | None = None,
         progress: Callable[[str], None] | None = None) -> TuneResult:
    """The fastest fitting candidates of ``space`` for ``base`` on ``hw`` (see the module doc)."""
    return _Search(base, hw, space, opts or Options(), progress).run()
