"""The tuner's cost tables: per-stage times and parameters built from a few cached pieces, and the lower bounds.

``perf.stage_times`` adds a stage's work item by item: every block (its forward, backward and weight gradient,
tensor- and expert-parallel collectives, main-grad hooks) independently of the other blocks of the stage, then the
embedding, the MTP heads, the head + loss and the hooks of the parameters outside the blocks. So a stage's (f, b, w)
is exactly the sum of

* one entry per decoder block: its class (MoE or dense, sliding window, FP8 dense linears) and recompute mode;
* one "rest" entry per (embedding?, MTP depths with their recompute modes, loss?): the stage's work outside its
  decoder blocks.

``StageCosts`` computes each entry once per shape (degrees, micro-batch, optimizer precision) with ``stage_times``
itself on a one-entry stage, and composes any layout from them (tests/plan/test_tune.py checks the composition
against ``stage_times`` and ``project_perf``). A stage's parameters are ``memory.stage_params``', cached by what the
stage holds.

Lower bounds (valid for every layout, schedule and recompute choice of a shape): the busiest rank computes at least
the whole model's work divided by pp (recompute only adds), the step adds at least the tail of an average rank
(data-parallel communication and the optimizer grow with the parameters: the largest rank's tail is at least the
tail of the mean); a rank's memory is at least its parameters, optimizer state, the gradients kept across
micro-batches, the parameters FSDP gathers and one micro-batch's block inputs, taken at the average rank.
Pure Python.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moetrain.config.schema import Config
from moetrain.plan import fsdp
from moetrain.plan import activations as A
from moetrain.plan.activations import resolve_dims
from moetrain.plan.costs import Roofline
from moetrain.plan.layout import Layout, Stage
from moetrain.plan.memory import DTYPE_BYTES, WORKSPACE, _window, stage_params
from moetrain.plan.perf import rank_tail, stage_times

@dataclass(frozen=True)
class Work:
    """Seconds of one stage (or part of one) per micro-batch: forward, input gradient, weight gradient, and the
    communication inside them."""

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0
    comm: float = 0.0

    def __add__(self, o: "Work") -> "Work":
        return Work(self.f + o.f, self.b + o.b, self.w + o.w, self.comm + o.comm)

    def __sub__(self, o: "Work") -> "Work":
        return Work(self.f - o.f, self.b - o.b, self.w - o.w, self.comm - o.comm)

    @property
    def total(self) -> float:
        return self.f + self.b + self.w


@dataclass(frozen=True)
class Params:
    dense: float = 0.0
    expert: float = 0.0
    blocks: int = 0

    def __add__(self, o: "Params") -> "Params":
        return Params(self.dense + o.dense, self.expert + o.expert, self.blocks + o.blocks)


class StageCosts:
    """Per-stage work and parameters of one shape (``cfg`` without its pipeline: any layout of its model)."""

    def __init__(self, cfg: Config, hw, attention: str = "auto", moe_imbalance: float = 1.0,
                 tables: dict | None = None):
        """``tables``: a dict shared by shapes whose blocks cost the same (same tp, cp, ep, etp, micro-batch and
        optimizer precision: pp, dp and dp_replicate change neither a block's work nor its parameters)."""
        self.cfg, self.hw = cfg, hw
        self.L, self.D = cfg.model.num_layers, cfg.model.mtp_num_layers
        self.d = resolve_dims(cfg, attention, moe_imbalance, "cuda")
        self.rf = Roofline(hw, cfg.precision.dtype)
        self._fp8 = set(cfg.fp8_dense_layers())
        tables = {} if tables is None else tables
        self._block: dict[tuple, Work] = tables.setdefault("block", {})
        self._rest: dict[tuple, Work] = tables.setdefault("rest", {})
        self._params: dict[tuple, Params] = tables.setdefault("params", {})
        self._tails: dict[tuple, float] = {}  # per shape: the tail depends on dp, pp and the micro-batches too
        self.memo: dict = {}  # per shape, for callers (the tuner's per-layout sums)

    def block_class(self, gid: int) -> tuple:
        """Decoder blocks of one class cost the same: (MoE?, sliding window, FP8 dense linears)."""
        return (self.cfg.is_moe_layer(gid), _window(self.cfg, gid), gid in self._fp8)

    def _representative(self, cls: tuple) -> int:
        return next(gid for gid in range(self.L) if self.block_class(gid) == cls)

    def _stage(self, layers: list[int], embedding: bool = False, mtp: int = 0, loss: bool = False) -> Stage:
        items = (["E"] if embedding else []) + ["t"] * len(layers) + ["m"] * mtp + (["L"] if loss else [])
        return Stage(index=0, rank=0, chunk=0, items=items, layers=list(layers), mtp=list(range(mtp)))

    def _times(self, cfg: Config, stage: Stage) -> Work:
        sp = stage_params(cfg, stage)
        st = stage_times(cfg, self.hw, self.d, self.rf, Layout([stage], 1, 1, ""), None, {"block_params": sp.by_block})
        return Work(st[0].f, st[0].b, st[0].w, st[0].comm)

    def _with(self, base: str, full: list[int]) -> Config:
        c = self.cfg
        train = dataclasses.replace(c.train, recompute=base, recompute_layer_ids=full or None)
        return dataclasses.replace(c, train=train)

    def block(self, gid: int, mode: str) -> Work:
        """One decoder block (its stage holds nothing else, so no hook outside it is charged)."""
        key = (self.block_class(gid), mode)
        if key not in self._block:
            self._block[key] = self._times(self._with(mode, []), self._stage([self._representative(key[0])]))
        return self._block[key]

    def rest(self, embedding: bool, mtp_modes: tuple[str, ...], loss: bool) -> Work:
        """A stage's work besides its decoder blocks: the embedding, the MTP depths (block and head, each in its
        recompute mode), the head + loss, and the hooks of the parameters outside the blocks."""
        key = (embedding, mtp_modes, loss)
        if key not in self._rest:
            base = "selective" if "selective" in mtp_modes else "none"
            full = [self.L + d for d, mode in enumerate(mtp_modes) if mode == "full"]
            self._rest[key] = self._times(self._with(base, full), self._stage([], embedding, len(mtp_modes), loss))
        return self._rest[key]

    def stage_work(self, stage: Stage, mode_of) -> Work:
        """(f, b, w, comm) of ``stage`` per micro-batch; ``mode_of(gid)`` is each block's recompute mode."""
        out = Work()
        for gid in stage.layers:
            out = out + self.block(gid, mode_of(gid))
        if stage.has_embedding or stage.mtp or stage.has_loss:
            modes = tuple(mode_of(self.L + d) for d in stage.mtp)
            out = out + self.rest(stage.has_embedding, modes, stage.has_loss)
        return out

    def model_work(self) -> float:
        """f + b + w of the whole model without recompute, per micro-batch: a one-stage layout's. Splitting it
        never removes work (an MTP stage without the embedding adds its copy's hooks)."""
        blocks = sum(self.block(gid, "none").total for gid in range(self.L))
        return blocks + self.rest(True, ("none",) * self.D, True).total

    def stage_params(self, stage: Stage) -> Params:
        """Local parameters of ``stage`` (``memory.stage_params``, cached by what the stage holds)."""
        classes = tuple(sorted((self.block_class(g) for g in stage.layers), key=repr))
        key = (stage.has_embedding, classes, len(stage.mtp), stage.has_loss)
        if key not in self._params:
            sp = stage_params(self.cfg, stage)
            self._params[key] = Params(sp.dense, sp.expert, len(sp.by_block))
        return self._params[key]

    def model_params(self) -> Params:
        return self.stage_params(self._stage(list(range(self.L)), True, self.D, True))

    # ---- bounds ----------------------------------------------------------------------------------------------

    def time_bound(self, pp: int, dp_overlap: float) -> float:
        """A lower bound of the step time of any layout, schedule and recompute choice of this shape."""
        mp = self.model_params()
        tail = self.tail(mp.dense / pp, mp.expert / pp, max(mp.blocks // pp, 1), dp_overlap)
        return self.cfg.grad_accum_steps * self.model_work() / pp + tail

    def memory_bound(self, pp: int) -> float:
        """A lower bound of the busiest rank's allocated bytes (see the module doc), at the average rank."""
        mp = self.model_params()
        return self.rank_memory_bound(mp.dense / pp, mp.expert / pp, (self.L + self.D) / pp * self.block_input)

    @property
    def block_input(self) -> float:
        """Bytes a fully recomputed block keeps per micro-batch (its input), the least any recompute mode keeps."""
        return self.d.b * self.d.Th * self.cfg.model.hidden_size

    def block_transient(self, gid: int) -> float:
        """Bytes a block's backward holds above its saved input, at least: its activations without recompute (saved,
        or rebuilt by the recompute) and its backward working set (``activations.block_backward_extra`` without
        gradient terms)."""
        moe = self.cfg.block_is_moe(gid)
        win = _window(self.cfg, gid) if gid < self.L else None
        key = ("transient", moe, win)
        if key not in self._params:
            b_p = DTYPE_BYTES[self.cfg.precision.dtype]
            none = A.block_terms(self.cfg, self.d, moe, win, "none")
            extra = A.block_backward_extra(self.cfg, self.d, moe, win, "none", b_p, none)
            self._params[key] = A.total(none) - self.block_input + extra
        return self._params[key]

    def block_params(self, gid: int) -> float:
        """Local parameters of one block (``memory.stage_params``' by_block)."""
        key = ("block params", self.block_class(gid) if gid < self.L else "mtp")
        if key not in self._params:
            stage = self._stage([gid]) if gid < self.L else self._stage([], mtp=1)
            self._params[key] = stage_params(self.cfg, stage).by_block[gid if gid < self.L else self.L]
        return self._params[key]

    def gathered_gradients(self, largest_block: float) -> float:
        """What FSDP adds in backward for the largest block: its unsharded gradient and the reduce-dtype copy."""
        if not fsdp.applies(self.cfg):
            return 0.0
        return (DTYPE_BYTES[self.cfg.precision.dtype] + DTYPE_BYTES[self.cfg.optim.main_grads_dtype]) * largest_block

    def loss_transient(self) -> float:
        """The cross-entropy backward's gradients, alive at the start of a loss stage's backward."""
        return A.ce_transients(self.cfg, self.d)[1]

    def rank_memory_bound(self, dense: float, expert: float, activations: float) -> float:
        """A lower bound of the allocated bytes of a rank holding these local parameters and at least these saved
        activations at once: parameters, optimizer state, gradients kept across micro-batches, gathered
        parameters, the activations and a workspace."""
        cfg = self.cfg
        b_p = DTYPE_BYTES[cfg.precision.dtype]
        if not fsdp.applies(cfg):
            o = cfg.optim
            master = 4 if (cfg.precision.master_weights and b_p != 4) else 0
            state = master + DTYPE_BYTES[o.exp_avg_dtype] + DTYPE_BYTES[o.exp_avg_sq_dtype]
            return (b_p + state) * (dense + expert) + activations + WORKSPACE
        fs = fsdp.memory(cfg, dense, expert, 0.0, 0.0, cfg.grad_accum_steps)
        return fs.params + fs.optimizer + fs.accumulated + fs.gathered_forward + activations + WORKSPACE

    def tail(self, dense: float, expert: float, blocks: int, dp_overlap: float) -> float:
        """``perf.rank_tail``'s whole tail, cached (it depends on the shape and these numbers only)."""
        key = (dense, expert, blocks, dp_overlap)
        if key not in self._tails:
            self._tails[key] = rank_tail(self.cfg, self.hw, dense, expert, blocks, dp_overlap)[3]
        return self._tails[key]
