"""What `moetrain plan tune` searches: parallel shapes, pipeline schedules, optimizer precisions, and how a
candidate becomes a Config.

A shape fixes the degrees (tp, cp, pp, dp, dp_replicate, ep, etp), the micro-batch and the optimizer precision:
everything but the pipeline (schedule, vpp, layout) and the recompute choice, which the search adds per shape. A
candidate is a dict of dotted keys (``overrides``) on top of the user's config; ``derive`` applies them and runs
``Config.check``, the same check ``moetrain train`` and ``plan memory|perf`` run.

* tp: divisors of the GPUs up to a node that ``check_tensor_parallel`` accepts; sequence parallelism with tp > 1
  (it only removes activations: the projection charges its all-gather + reduce-scatter what the all-reduce costs).
* pp: divisors, at most the blocks (layers + MTP depths); dp = GPUs / (tp cp pp) must divide the global batch.
* ep: divisors of the experts that tp divides or that divide tp, folding over the sharded data-parallel ranks.
* data parallelism is FSDP2 (the trainer's only kind): sharded over all of dp, or HSDP with the shards inside a node
  and the replicas across nodes (parallel.dp_replicate). ZeRO-1 (optim.distributed) is retired.
* cp and etp: 1. The trainer refuses parallel.cp > 1 and parallel.etp > 1 (not built); ``plan_only`` adds them for a
  projection of what they would give.
* micro-batch: divisors of the per-rank batch up to ``max_mbs``.
* optimizer precision (``OPTIM``): fp32 state; bf16 moments; bf16 main gradients and moments (the precision-aware
  optimizer's recipe, fp32 master weights kept); ``bf16-all`` (no fp32 master weights) only when asked.
Keys the user set on the command line stay fixed: the search only takes candidates that agree with them.
Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moetrain.config.pipeline_layout import V_SCHEDULES
from moetrain.config.relations import check_tensor_parallel
from moetrain.config.schema import Config, ConfigError

OPTIM = {  # name -> precision.master_weights, optim.main_grads_dtype, optim.exp_avg_dtype, optim.exp_avg_sq_dtype
    "fp32": (True, "fp32", "fp32", "fp32"),
    "bf16-moments": (True, "fp32", "bf16", "bf16"),
    "bf16-grads-moments": (True, "bf16", "bf16", "bf16"),
    "bf16-all": (False, "bf16", "bf16", "bf16"),
}
DEFAULT_OPTIM = ("fp32", "bf16-moments", "bf16-grads-moments")
OPTIM_KEYS = ("precision.master_weights", "optim.main_grads_dtype", "optim.exp_avg_dtype", "optim.exp_avg_sq_dtype")
TUNED_KEYS = ("parallel.tp", "parallel.sequence_parallel", "parallel.cp", "parallel.pp", "parallel.vpp",
              "parallel.pp_schedule", "parallel.pipeline_layout", "parallel.dp", "parallel.dp_replicate", "parallel.ep",
              "parallel.etp", "train.micro_batch_size", "train.global_batch_size", "train.recompute",
              "train.recompute_layer_ids") + OPTIM_KEYS


@dataclass(frozen=True, order=True)
class Shape:
    tp: int
    cp: int
    pp: int
    dp: int
    dp_replicate: int
    ep: int
    etp: int
    mbs: int
    optim: str

    def overrides(self, gbs: int) -> dict:
        out = {"parallel.tp": self.tp, "parallel.sequence_parallel": self.tp > 1, "parallel.cp": self.cp,
               "parallel.pp": self.pp, "parallel.dp": self.dp, "parallel.dp_replicate": self.dp_replicate,
               "parallel.ep": self.ep, "parallel.etp": self.etp, "train.micro_batch_size": self.mbs,
               "train.global_batch_size": gbs}
        out.update(dict(zip(OPTIM_KEYS, OPTIM[self.optim])))
        return out

    def describe(self) -> str:
        extra = (f" cp{self.cp}" if self.cp > 1 else "") + (f" etp{self.etp}" if self.etp > 1 else "")
        hsdp = f" hsdp{self.dp_replicate}" if self.dp_replicate > 1 else ""
        return f"tp{self.tp} pp{self.pp} ep{self.ep} dp{self.dp}{hsdp}{extra} mbs{self.mbs} {self.optim}"


@dataclass(frozen=True)
class Space:
    """Bounds of the search."""

    gpus: int
    global_batch: int
    optim: tuple[str, ...] = DEFAULT_OPTIM
    max_mbs: int = 8
    max_vpp: int = 8
    plan_only: bool = False
    fixed: tuple[tuple[str, object], ...] = ()  # (dotted key, value) the user set


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def derive(base: Config, overrides: dict, check: bool = True) -> Config:
    """``base`` with the dotted ``overrides`` set (a new Config; the sections it changes are new, the others shared
    with ``base``, whose values are never changed in place); ``Config.check`` run unless ``check`` is False."""
    changes: dict[str, dict] = {}
    for key, value in overrides.items():
        section, name = key.split(".")
        changes.setdefault(section, {})[name] = list(value) if isinstance(value, list) else value
    cfg = dataclasses.replace(base, **{s: dataclasses.replace(getattr(base, s), **kw) for s, kw in changes.items()})
    if check:
        cfg.check()
    return cfg


def agrees(overrides: dict, fixed: tuple) -> bool:
    return all(overrides.get(k, v) == v for k, v in fixed)


def _tp_ok(base: Config, tp: int) -> bool:
    try:
        check_tensor_parallel(base, tp)
    except ConfigError:
        return False
    return True


def _replicas(dp: int, tp: int, cp: int, ep: int, etp: int, gpus_per_node: int) -> list[int]:
    """dp_replicate choices: 1 (FSDP over all of dp), and HSDP with each shard group filling a node."""
    shard = max(gpus_per_node // (tp * cp), 1)
    out = [1]
    if shard < dp and dp % shard == 0 and (shard * cp * tp) % (ep * etp) == 0:
        out.append(dp // shard)
    return out


def shapes(base: Config, space: Space) -> list[Shape]:
    """Every shape of ``space`` (sorted) whose degrees divide as the trainer needs (the schedule's micro-batch rules
    and the layouts are checked per pipeline option)."""
    m, e = base.model, base.moe
    gpn, gbs = base.parallel.gpus_per_node, space.global_batch
    blocks = m.num_layers + m.mtp_num_layers
    extra = divisors(min(space.gpus, gpn)) if space.plan_only else [1]
    out = []
    for tp in divisors(min(space.gpus, gpn)):
        if not _tp_ok(base, tp):
            continue
        for cp in extra:
            if base.train.seq_length % cp or tp * cp > space.gpus or space.gpus % (tp * cp):
                continue
            for pp in divisors(space.gpus // (tp * cp)):
                dp = space.gpus // (tp * cp * pp)
                if pp > blocks or gbs % dp:
                    continue
                for ep in divisors(e.num_experts) if e.num_experts else [1]:
                    if ep % tp and tp % ep:
                        continue
                    for etp in extra:
                        if (dp * cp * tp) % (ep * etp):
                            continue
                        for rep in _replicas(dp, tp, cp, ep, etp, gpn):
                            for mbs in divisors(gbs // dp):
                                if mbs > space.max_mbs:
                                    break
                                for opt in space.optim:
                                    s = Shape(tp, cp, pp, dp, rep, ep, etp, mbs, opt)
                                    if agrees(s.overrides(gbs), space.fixed):
                                        out.append(s)
    return sorted(out)


def pipelines(pp: int, blocks: int, micro_batches: int, max_vpp: int) -> list[tuple[str, int]]:
    """(schedule, vpp) options for pp ranks, at most ``blocks`` stages, that torch can run with these micro-batches
    (``check_schedule``)."""
    from moetrain.config.pipeline_layout import check_schedule

    if pp == 1:
        return [("1f1b", 1)]
    opts = [("1f1b", 1)] + [("interleaved", v) for v in range(2, max_vpp + 1)] + [(s, 2) for s in V_SCHEDULES]
    out = []
    for schedule, vpp in opts:
        if pp * vpp > blocks:
            continue
        try:
            check_schedule(schedule, pp, vpp, micro_batches)
        except ConfigError:
            continue
        out.append((schedule, vpp))
    return out


def shape_config(base: Config, shape: Shape, gbs: int) -> Config | None:
    """The config of a shape with a placeholder pipeline (1f1b, even layout) for the checks that do not depend on it,
    or None where ``Config.check`` refuses the degrees. The real pipeline options are checked one by one."""
    from moetrain.plan.tune_layouts import even

    over = shape.overrides(gbs)
    blocks = base.model.num_layers
    if shape.pp > 1:
        text = even(blocks, base.model.mtp_num_layers, shape.pp)
        if text is None:
            return None
        m = gbs // (shape.mbs * shape.dp)
        over.update({"parallel.pp_schedule": "1f1b", "parallel.vpp": 1, "parallel.pipeline_layout": text,
                     "train.global_batch_size": shape.mbs * shape.dp * max(m, shape.pp)})
    else:
        over.update({"parallel.pp_schedule": "1f1b", "parallel.vpp": 1, "parallel.pipeline_layout": None})
    try:
        cfg = derive(base, over)
    except ConfigError:
        return None
    return derive(cfg, {"train.global_batch_size": gbs}, check=False)  # the placeholder passed 1f1b's micro-batch rule
