"""The pipeline-parallel trainer: ``DistributedTrainer`` with parallel.pp > 1, its stages run by torch's schedules.

What differs from the distributed trainer (``distributed.pipeline`` has the stages, their wrapper and the schedule):
- the model: this rank's stages, cut from the meta model by the layout, each prepared as the distributed trainer
  prepares the whole model (expert parallelism, recompute, FP8 dense linears, compile, FSDP2 with the stage's wrapper
  as root), initialised from one base seed (the single-device weights), held by ``PipelineStages``;
- a step: every pipeline rank reads the step's micro-batches (its data-parallel share); one ``schedule.step`` runs
  all of them (forward, backward, deferred weight gradients under the V schedules); the tied embedding's gradients
  are summed over its two holders; the loss terms are summed over the pipeline ranks (the last stage has the LM and
  MTP losses, every stage its MoE layers' aux losses) before the data-parallel reductions; the gradient norm sums
  over the pipeline ranks;
- evaluation: the schedule's forward-only pass over whole steps of micro-batches;
- train.pp_warmup: one forward + backward of each local stage before step 1, its gradients and counts dropped;
- profile.dump_pp_data: each rank's forward / backward / weight steps timed for the profiled steps
  (``distributed.pipeline_timing``).
"""

from __future__ import annotations

import contextlib
import math

import torch

from moetrain.train.distributed_trainer import DistributedTrainer
from moetrain.train.steps import LossTerms, StepResult


class PipelineTrainer(DistributedTrainer):
    @property
    def sharded(self) -> bool:
        return True

    @property
    def pp_rank(self) -> int:
        return self.meshes.pp.get_local_rank()

    def build_model(self):
        from moetrain.distributed import pipeline as pl
        from moetrain.distributed.fsdp import apply_fsdp
        from moetrain.models import build_model, init
        from moetrain.train.optim import DTYPES

        cfg = self.cfg
        whole = build_model(cfg, device="meta")
        storage = torch.float32 if cfg.precision.master_weights or self.device.type != "cuda" else self.dtype
        whole.to(storage)
        whole_names = set(whole.state_dict())
        self.n_stages = cfg.parallel.pp * cfg.parallel.vpp
        ids = pl.local_stage_ids(cfg, self.pp_rank)
        reduce_dtype = DTYPES[cfg.optim.main_grads_dtype] if self.device.type == "cuda" else torch.float32
        stages = []
        ep_groups = [None, None]  # each local stage's dispatchers on their own group under moe.overlap_a2a
        if cfg.moe.overlap_a2a:
            from moetrain.distributed.overlap import chunk_ep_groups

            ep_groups = chunk_ep_groups(self.meshes)
        for chunk, part in enumerate(pl.split_model(whole, cfg, ids)):
            self.parallelize(part, ep_group=ep_groups[chunk] if chunk < 2 else None)
            self.prepare_model(part)
            stage = pl.StageModule(part, cfg.grad_accum_steps)
            apply_fsdp(part, self.meshes, self.dtype, reduce_dtype, root=stage, reshard_blocks=False)
            stages.append(stage)
        del whole
        seed = init.base_seed()  # one draw, as the whole model's init makes: every stage from the same base seed
        for stage in stages:
            stage.to_empty(device=self.device)
            stage.model.init_weights(seed)
            if cfg.model.from_hf and not self.start.candidates:
                from moetrain.models.hf import load_hf_weights

                load_hf_weights(stage.model, cfg.model.from_hf, progress=self.show_progress and self.is_main)
        model = pl.PipelineStages(stages, ids, whole_names, len(pl.moe_block_order(cfg)), self.meshes.pp.get_group())
        self.tied = pl.tied_weights(model, self.n_stages, self.meshes)
        if self.tied is not None:
            self.tied.refresh()
        self._build_schedule(model)
        return model

    def _build_schedule(self, model) -> None:
        from moetrain import ops
        from moetrain.distributed import pipeline as pl

        self.pending = ops.PendingWeightGrads()
        p = self.cfg.parallel
        self.schedule, self.pipe_stages = pl.build_schedule(
            self.cfg, model, self.n_stages, self.device, self.dtype, seq_shards=p.tp if p.sequence_parallel else 1,
            pp_group=self.meshes.pp.get_group(), dw_builder=self.pending.take)
        if self.cfg.moe.overlap_a2a:
            from moetrain.distributed import overlap

            overlap.install(self.schedule, self.device)
        self.timer = self.timeline = None
        first_pipeline = self.meshes.dp.get_local_rank() == 0 and (
            self.meshes.tp is None or self.meshes.tp.get_local_rank() == 0)
        if self.cfg.profile.dump_pp_data and first_pipeline:  # one pipeline's ranks record: files per pp rank
            from moetrain.distributed.pipeline_timing import StageTimer

            self.timer = StageTimer(self.pipe_stages, self.device)

    def build_optimizer(self):
        opt = super().build_optimizer()
        opt.norm_outer_group = self.meshes.pp.get_group()
        if self.tied is not None and self.tied.first is None and self.tied.last is not None:
            opt.norm_excluded = {"embed.weight"}  # stage 0's rank counts the embedding's gradient
        return opt

    # ---- a step ----------------------------------------------------------------------------------------------

    def _schedule_context(self):
        """Deferred weight gradients for the V schedules' weight steps (PipelineStage's dw_builder takes them)."""
        from moetrain import ops
        from moetrain.config.pipeline_layout import V_SCHEDULES

        if self.cfg.parallel.pp_schedule in V_SCHEDULES:
            return ops.defer_weight_grads(self.pending)
        return contextlib.nullcontext()

    def _run_schedule(self, micro_batches, train: bool) -> None:
        batches = list(micro_batches)
        inputs = torch.cat([b[0] for b in batches]).to(self.device)
        labels = torch.cat([b[1] for b in batches]).to(self.device)
        for stage in self.model.stages:
            stage.reset_terms(self.device)
        args = (inputs,) if 0 in self.model.stage_ids else ()
        with self.loss_context():
            if train:
                with self._schedule_context():
                    self.schedule.step(*args, target=labels, labels=labels)
            else:
                self.schedule.eval(*args, target=labels, labels=labels)

    def _pipeline_terms(self) -> torch.Tensor:
        """The step's loss terms [4] summed over the pipeline ranks, the loss formed from them."""
        import torch.distributed as dist

        terms = torch.stack([stage.terms for stage in self.model.stages]).sum(0)
        dist.all_reduce(terms, group=self.meshes.pp.get_group())
        terms[0] = terms[1] + terms[2] + self.cfg.model.mtp_loss_scale * terms[3]
        return terms

    def forward_backward(self, micro_batches) -> LossTerms:
        p = self.cfg.profile
        timed = self.timer is not None and p.start_step <= self.step <= p.end_step
        if timed:
            self.timer.start_step(self.meshes.pp.get_group())
        self._run_schedule(micro_batches, train=True)
        if timed:
            self._record_timeline(self.timer.end_step())
        if self.tied is not None:
            self.tied.sum_grads()
        return self.reduce_step(self._pipeline_terms())

    def train_step(self, step: int) -> StepResult:
        self.step = step
        if self.cfg.train.pp_warmup and step == self.start_step + 1:
            self._warm_up()
        result = super().train_step(step)
        if self.tied is not None:
            self.tied.refresh()
        return result

    def _warm_up(self) -> None:
        """train.pp_warmup: one forward + backward of each local stage on its own, on random tokens / hidden states
        from a generator of its own (the global RNG is not touched); the train step that follows zeroes the
        gradients and the MoE counts."""
        t, m = self.cfg.train, self.cfg.model
        g = torch.Generator(device="cpu").manual_seed(0)
        tokens = torch.randint(0, m.vocab_size, (t.micro_batch_size, t.seq_length), generator=g).to(self.device)
        for stage in self.model.stages:
            if stage.model.embeds_input:
                inputs = tokens
            else:
                shards = self.cfg.parallel.tp if self.cfg.parallel.sequence_parallel else 1
                h = torch.randn(t.micro_batch_size, t.seq_length // shards, m.hidden_size, generator=g) * m.init_std
                inputs = h.to(self.device, self.dtype).requires_grad_()
            with self.loss_context():
                out = stage(inputs, tokens)
                out.backward(torch.ones_like(out))
        self.model.reset_moe_stats()

    def _record_timeline(self, ops: list[dict]) -> None:
        """This rank's ops of the profiled step, with its peak memory, to out_dir/pp_timeline/rank<r>.json."""
        from moetrain.train.loop_support import peak_memory_gib

        if self.timeline is None:
            from moetrain.plan.timeline import RankTimelineWriter

            p = self.cfg.parallel
            meta = {"schedule": p.pp_schedule, "pp": p.pp, "vpp": p.vpp, "micro_batches": self.accum}
            self.timeline = RankTimelineWriter(self.out_dir, self.pp_rank, meta)
        self.timeline.add_step(self.step, ops, peak_memory_gib(self.device))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean LM loss over the eval split's first train.eval_steps micro-batches, rounded up to whole steps of
        micro-batches (the schedule runs a step's worth at a time)."""
        from moetrain.distributed.reduce import mean_over
        from moetrain.train.data import build_data

        cfg = self.cfg
        data = build_data(cfg, cfg.model.vocab_size, "eval", *self.data_rank)
        rounds = math.ceil(cfg.train.eval_steps / self.accum)
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for _ in range(rounds):
            self._run_schedule([data.next_batch(cfg.train.micro_batch_size) for _ in range(self.accum)], train=False)
            total += self._pipeline_terms()[1]
        self.model.train(was_training)
        self.model.reset_moe_stats()
        mean_over(total, self.meshes.dp.get_group())
        return (total / rounds).item()

    def _restore(self, train_data) -> None:
        super()._restore(train_data)
        if self.tied is not None:
            self.tied.refresh()
