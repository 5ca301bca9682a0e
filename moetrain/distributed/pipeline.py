"""Pipeline parallelism on ``torch.distributed.pipelining``: this rank's stages, their wrapper, the schedule.

Stages come from ``parallel.pipeline_layout`` (or the even default, ``config.pipeline_layout.default_layout``):
pp x vpp stages in pipeline order, stage i on pipeline rank ``stage_rank(i, pp, pp_schedule)`` (looped for 1f1b and
interleaved, V for zero_bubble and dualpipev). A rank's stages are deep copies of the (meta) model reduced by
``MoETransformer.keep_only``, so their parameters keep the whole model's names (``models.stages``).

``StageModule`` is what torch's ``PipelineStage`` runs: forward(inputs, labels) -> the stage's output h
[B, S_local, H], or on the last stage the micro-batch's training loss divided by the micro-batches per step (fp32
[1]: the schedule's loss function takes it as the loss and torch runs its backward), keeping the detached loss terms
for logging. Labels travel as a keyword argument to every stage (torch chunks it like the inputs); the
MTP depths on the last stage read them.

``PipelineStages`` holds a rank's stage modules and presents them to the trainer as one model: parameters and state
under the whole model's names, the MoE layers of every stage, and the load imbalance of every MoE layer of the
model (summed over the pipeline ranks, each layer living on one).

Weights two stages both hold (the input embedding, which the last stage keeps for a tied head or the MTP depths):
a copy in each stage whose gradients are summed over the holders after the step's backward (``TiedWeights``); each
holder updates its copy from the same gradient and state, so the copies stay equal. The gradient norm counts the
first stage's copy only. Where both holders are one rank (V placement: stage 0 and the last stage on rank 0), the
optimizer updates the first copy and the other is refreshed from it after each update and load.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from moetrain.config.pipeline_layout import V_SCHEDULES, default_layout, stage_rank
from moetrain.models.stages import stage_contents


def layout_text(cfg) -> str:
    """parallel.pipeline_layout, or the default even split of pp x vpp stages."""
    p, m = cfg.parallel, cfg.model
    if p.pipeline_layout is not None:
        return p.pipeline_layout
    return default_layout(m.num_layers, m.mtp_num_layers, p.pp * p.vpp)


def local_stage_ids(cfg, pp_rank: int) -> list[int]:
    """The pipeline stages on pipeline rank ``pp_rank``, in pipeline order."""
    p = cfg.parallel
    return [i for i in range(p.pp * p.vpp) if stage_rank(i, p.pp, p.pp_schedule) == pp_rank]


def split_model(model, cfg, stage_ids: list[int]) -> list:
    """Deep copies of ``model`` (whole, typically on the meta device), each reduced to one stage of ``stage_ids``."""
    m = cfg.model
    parts = stage_contents(layout_text(cfg), m.num_layers, m.mtp_num_layers)
    out = []
    for i in stage_ids:
        p = parts[i]
        out.append(copy.deepcopy(model).keep_only(p["layers"], p["mtp"], embedding=p["embedding"], loss=p["loss"]))
    return out


class StageModule(nn.Module):
    """One pipeline stage as torch's PipelineStage calls it (see the module doc). ``terms`` [4] fp32 accumulates
    the step's per-micro-batch loss terms divided by ``accum``: (0, lm_loss, aux_loss of this stage's MoE layers,
    mtp_loss); the trainer sums them over the pipeline ranks and forms the loss."""

    def __init__(self, model, accum: int):
        super().__init__()
        self.model = model
        self.accum = accum
        self.terms: torch.Tensor | None = None

    @property
    def is_last(self) -> bool:
        return self.model.final_norm is not None

    def reset_terms(self, device: torch.device) -> None:
        self.terms = torch.zeros(4, device=device)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.model(inputs, labels)
        if not self.is_last:
            zero = torch.zeros((), device=out.device)
            self._add(zero, self.model.aux_value() if self.model.moe_layers() else zero, None)  # a stage may be empty
            return out
        self._add(out.lm_loss, out.aux_loss, out.mtp_loss)
        return torch.stack([out.loss]) / self.accum  # not a view: FSDP hooks the output for its backward

    def _add(self, lm: torch.Tensor, aux: torch.Tensor, mtp: torch.Tensor | None) -> None:
        if self.terms is None:
            return
        mtp = torch.zeros_like(lm) if mtp is None else mtp
        self.terms += torch.stack([torch.zeros_like(lm), lm, aux.to(lm.dtype), mtp]).detach() / self.accum


class PipelineStages(nn.Module):
    """A rank's stage modules (``StageModule``) as one model for the trainer (see the module doc).
    ``whole_names``: every parameter and buffer name of the whole model (a checkpoint of it fits this rank)."""

    def __init__(self, stages: list[StageModule], stage_ids: list[int], whole_names: set[str], moe_layer_count: int,
                 pp_group):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.stage_ids = stage_ids
        self.pp_group = pp_group
        self.moe_layer_count = moe_layer_count
        self.cfg = stages[0].model.cfg
        local = set(self.state_dict())
        self.keys_elsewhere = whole_names - local  # held by other pipeline ranks (resume.check_shapes accepts them)

    @property
    def models(self) -> list:
        return [s.model for s in self.stages]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Each parameter under its whole-model name, a name held twice on this rank (a tied copy) once."""
        seen = set()
        for model in self.models:
            for name, p in model.named_parameters(prefix=prefix, recurse=recurse):
                if name not in seen:
                    seen.add(name)
                    yield name, p

    def state_dict(self, *args, **kwargs) -> dict:
        """The stages' state under the whole model's names (a name held twice on this rank: its first copy)."""
        out = {}
        for model in self.models:
            for name, t in model.state_dict().items():
                out.setdefault(name, t)
        return out

    def blocks(self) -> list:
        return [b for model in self.models for b in model.blocks()]

    def moe_layers(self) -> list:
        return [layer for model in self.models for layer in model.moe_layers()]

    @torch.no_grad()
    def reset_moe_stats(self) -> None:
        for model in self.models:
            model.reset_moe_stats()

    @torch.no_grad()
    def update_expert_bias(self, rate: float | None = None, keep: torch.Tensor | None = None) -> None:
        for model in self.models:
            model.update_expert_bias(rate, keep)

    def set_aux_grad_scale(self, scale: float) -> None:
        for model in self.models:
            model.set_aux_grad_scale(scale)

    @torch.no_grad()
    def load_imbalance(self) -> torch.Tensor | None:
        """[MoE layers of the whole model] fp32, in global block order: each rank fills its layers' entries and the
        pipeline ranks sum (one small all-reduce)."""
        if not self.moe_layer_count:
            return None
        import torch.distributed as dist

        ids = [gid for gid, blk in self.blocks() if blk.is_moe]
        order = moe_block_order(self.cfg)
        device = next(self.parameters()).device
        out = torch.zeros(self.moe_layer_count, device=device)
        for gid, layer in zip(ids, self.moe_layers()):
            out[order.index(gid)] = layer.load_imbalance()
        dist.all_reduce(out, group=self.pp_group)
        return out


def moe_block_order(cfg) -> list[int]:
    """Global block ids of the whole model's MoE blocks, in order (decoder layers, then MTP depths)."""
    m = cfg.model
    return [i for i in range(m.num_layers + m.mtp_num_layers) if cfg.block_is_moe(i)]


class TiedWeights:
    """The input embedding held by the first and the last stage (see the module doc). ``first``, ``last``: this
    rank's copies (None where it holds none); ``group``: the process group of the two holding ranks where they
    differ (None on ranks holding one copy only outside such a group, or both)."""

    def __init__(self, first: nn.Parameter | None, last: nn.Parameter | None, group):
        self.first, self.last, self.group = first, last, group

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    @torch.no_grad()
    def sum_grads(self) -> None:
        """After the backward: every copy's gradient becomes the sum of both copies' gradients."""
        import torch.distributed as dist

        if self.first is not None and self.last is not None:  # both on this rank: the optimizer steps `first`
            self._local(self.first.grad).add_(self._local(self.last.grad))
            self.last.grad = None
        elif self.group is not None:
            held = self.first if self.first is not None else self.last
            dist.all_reduce(self._local(held.grad), group=self.group)

    @torch.no_grad()
    def refresh(self) -> None:
        """After an update or a load: the second copy on a rank holding both takes the first's values."""
        if self.first is not None and self.last is not None:
            self._local(self.last).copy_(self._local(self.first))


def tied_weights(stages: PipelineStages, n_stages: int, meshes) -> TiedWeights | None:
    """The ``TiedWeights`` of this rank (a collective: every rank calls it), or None where no stage but the first
    holds the embedding."""
    import torch.distributed as dist

    cfg = stages.cfg
    p = cfg.parallel
    last_rank = stage_rank(n_stages - 1, p.pp, p.pp_schedule)
    last_needs = stage_contents(layout_text(cfg), cfg.model.num_layers, cfg.model.mtp_num_layers)[-1]
    last_holds = n_stages > 1 and (cfg.model.tie_embeddings or bool(last_needs["mtp"]))
    if not last_holds:
        return None
    by_stage = dict(zip(stages.stage_ids, stages.models))
    first = by_stage[0].embed.weight if 0 in by_stage else None
    last = by_stage[n_stages - 1].embed.weight if n_stages - 1 in by_stage else None
    group = None
    if last_rank != 0:
        # one group per (data, tensor) coordinate: its pipeline rank 0 and the last stage's rank, same shards
        ranks = meshes.root.mesh.reshape(p.pp, -1)
        pairs = [[int(ranks[0, c]), int(ranks[last_rank, c])] for c in range(ranks.shape[1])]
        mine, _ = dist.new_subgroups_by_enumeration(pairs)
        group = mine if (first is not None or last is not None) else None
    return TiedWeights(first, last, group)


def build_schedule(cfg, stages: PipelineStages, n_stages: int, device: torch.device, dtype: torch.dtype,
                   seq_shards: int, pp_group, dw_builder=None):
    """torch's schedule for parallel.pp_schedule over this rank's stages. ``seq_shards``: how many pieces the
    sequence is cut into between stages (tp under sequence parallelism, else 1); ``dw_builder``: the deferred
    weight gradients' builder for the zero-bubble schedules (``ops.defer_weight_grads``)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    t, m, p = cfg.train, cfg.model, cfg.parallel
    B, S, H = t.micro_batch_size, t.seq_length, m.hidden_size
    hidden = torch.empty(B, S // seq_shards, H, dtype=dtype, device="meta", requires_grad=True)
    pipes = []
    for sid, module in zip(stages.stage_ids, stages.stages):
        inputs = torch.empty(B, S, dtype=torch.int64, device="meta") if sid == 0 else hidden
        loss = torch.empty(1, dtype=torch.float32, device="meta", requires_grad=True)
        outputs = loss if sid == n_stages - 1 else hidden
        pipes.append(PipelineStage(module, sid, n_stages, device, input_args=inputs, output_args=outputs,
                                   group=pp_group, dw_builder=dw_builder if p.pp_schedule in V_SCHEDULES else None))
    kinds = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B, "zero_bubble": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
    schedule_class = kinds[p.pp_schedule]
    arg = pipes[0] if p.pp_schedule == "1f1b" else pipes
    return schedule_class(arg, n_microbatches=cfg.grad_accum_steps, loss_fn=_pass_loss, scale_grads=False), pipes


def _pass_loss(output: torch.Tensor, target) -> torch.Tensor:
    """The schedule's loss function: the last stage already returns the micro-batch's loss / micro-batches, as a
    [1] tensor (the schedule concatenates the last stage's outputs)."""
    return output.sum()
