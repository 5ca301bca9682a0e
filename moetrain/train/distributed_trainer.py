"""The distributed trainer: ``Trainer`` under torchrun, with FSDP2 data parallelism and expert parallelism.

Every rank runs the same loop. What differs from one device:
- set-up: the process group and meshes from the rank order (``distributed.layout``, ``distributed.mesh``); the
  model built on the meta device, its experts sharded over the ep mesh, prepared as on one device (recompute, FP8
  dense linears, compile: ``Trainer.prepare_model``), FSDP2 applied (``distributed``'s order),
  then materialised and initialised shard by shard (the single-device weights for the same seed, ``models.init``).
  A one-rank job (torchrun --nproc_per_node 1) keeps the single-device model and optimizer: nothing to shard;
- data: data-parallel rank r of n reads micro-batch slices r, r + n, ... of the global batch, so a step trains on
  the same sequences as one device with the same global batch;
- a step: gradients are reduced once per step (FSDP's reduce-scatter on the last micro-batch only); the loss terms
  are averaged and the per-expert counts summed over the data-parallel ranks before the update, so every rank
  takes the same skip decision and moves the same expert bias; the gradient norm is one norm over every mesh;
- checkpoints: sharded, every rank writing its part (``train.sharded_checkpoint``), loadable under any layout;
  a stop signal on any rank stops all of them after the same step;
- output: rank 0 prints, writes metrics.jsonl and the run files; the others stay silent. A failing rank's error is
  printed once (``distributed.faults``).
"""

from __future__ import annotations

import dataclasses

import torch

from moetrain.errors import UserError
from moetrain.train.steps import LossTerms
from moetrain.train.trainer import Trainer

NOT_YET = {"cp": "context", "etp": "expert tensor"}


class DistributedTrainer(Trainer):
    def __init__(self, cfg, *, show_progress: bool | None = None):
        from moetrain.distributed.launch import device_for, init_process_group, require_launch
        from moetrain.distributed.layout import RankLayout, check_world
        from moetrain.distributed.mesh import build_meshes

        self.launch = launch = require_launch(cfg)
        self.ranks = RankLayout.from_config(cfg.parallel)
        try:
            check_world(self.ranks, launch.world_size)
        except ValueError as err:
            raise UserError(str(err)) from None
        self._refuse_unbuilt(cfg)
        device = device_for(cfg, launch)
        self.made_group = init_process_group(cfg, device, launch)
        self.meshes = build_meshes(self.ranks, device.type)
        self._device = device
        super().__init__(cfg, show_progress=show_progress if launch.rank == 0 else False)
        self.is_main = launch.rank == 0
        dp_mesh = self.meshes.dp
        self.data_rank = (dp_mesh.get_local_rank(), dp_mesh.size())
        self.gpus = launch.world_size
        if not self.is_main:
            self.say = self.warn = lambda *a, **k: None

    @staticmethod
    def _refuse_unbuilt(cfg) -> None:
        p, t = cfg.parallel, cfg.train
        for key, what in NOT_YET.items():
            if getattr(p, key) > 1:
                raise UserError(f"parallel.{key} = {getattr(p, key)}: {what} parallelism is not built yet; "
                                "data (parallel.dp, dp_replicate), expert (parallel.ep), tensor (parallel.tp, "
                                "sequence_parallel) and pipeline (parallel.pp) parallelism are")
        if t.cuda_graph:
            raise UserError("train.cuda_graph is not supported by the distributed trainer yet; set it to false")

    def check_layout(self) -> None:
        """The degrees were checked against the launch in ``__init__``."""

    def open_run(self) -> None:
        """Rank 0 prepares out_dir and decides how the run starts; every rank gets its decision."""
        import torch.distributed as dist

        box = [None]
        if self.is_main:
            try:
                super().open_run()
                box[0] = (self.projection, self.start)
            except UserError as err:
                box[0] = err
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], UserError):
            raise box[0]
        self.projection, self.start = box[0]

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 applies: more than one rank (on one, there is nothing to shard or reduce, and the model is
        the single-device one, bf16 parameters with fp32 masters in the optimizer where configured)."""
        return self.launch.world_size > 1

    def build_model(self):
        if not self.sharded:
            return super().build_model()
        from moetrain.distributed.fsdp import apply_fsdp
        from moetrain.models import build_model
        from moetrain.train.optim import DTYPES

        cfg = self.cfg
        model = build_model(cfg, device="meta")
        storage = torch.float32 if cfg.precision.master_weights or self.device.type != "cuda" else self.dtype
        model.to(storage)
        self.parallelize(model)
        self.prepare_model(model)
        reduce_dtype = DTYPES[cfg.optim.main_grads_dtype] if self.device.type == "cuda" else torch.float32
        apply_fsdp(model, self.meshes, self.dtype, reduce_dtype)
        model.to_empty(device=self.device)
        model.init_weights()  # the base seed: one draw from the global RNG, seeded alike on every rank; zeroes the
        if cfg.model.from_hf and not self.start.candidates:  # MoE counters (the only buffers)
            from moetrain.models.hf import load_hf_weights

            # each rank reads the tensors it holds a part of: its own experts only, dense tensors one at a time
            load_hf_weights(model, cfg.model.from_hf, progress=self.show_progress and self.is_main)
        return model

    def parallelize(self, model, ep_group=None) -> None:
        """Tensor parallelism, then expert parallelism (the experts' dispatchers over ``ep_group``, default the ep
        mesh's), on a meta model or pipeline stage: the first steps of ``distributed``'s order."""
        from moetrain.distributed.expert_parallel import shard_experts

        if self.meshes.tp is not None:
            from moetrain.distributed.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, self.meshes.tp, sequence_parallel=self.cfg.parallel.sequence_parallel)
        if self.meshes.ep is not None:
            shard_experts(model, self.meshes.ep, self.cfg.moe, group=ep_group)

    def loss_context(self):
        """What every forward and backward of a loss runs inside: under tensor parallelism torch's loss_parallel
        (the vocab-parallel cross-entropy on vocab-sharded logits: ``distributed.tensor_parallel``'s contract)."""
        import contextlib

        if self.meshes.tp is None:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def build_optimizer(self):
        if not self.sharded:
            return super().build_optimizer()
        from moetrain.distributed.reduce import shard_groups
        from moetrain.train.optim import PrecisionAwareAdamW

        opt = PrecisionAwareAdamW(self.model.named_parameters(), self.cfg.optim, self.cfg.precision.master_weights,
                                  main_grad_hooks=False)
        opt.norm_groups = [shard_groups(s.param) for s in opt.slots]
        return opt

    def forward_backward(self, micro_batches) -> LossTerms:
        """The micro-batches' forward + backward with the gradient reduce on the last one only; then the loss terms
        and expert counts reduced (``reduce_step``)."""
        sums = torch.zeros(4, device=self.device)
        with self.loss_context():
            for i, (input_ids, labels) in enumerate(micro_batches):
                if self.sharded:
                    self.model.set_requires_gradient_sync(i == self.accum - 1)
                sums += self.forward_backward_step(input_ids, labels).values / self.accum
        return self.reduce_step(sums)

    def reduce_step(self, sums: torch.Tensor) -> LossTerms:
        """After the step's backward: the expert weights' gradients rescaled (``fsdp.expert_grad_scale``), the loss
        terms ``sums`` [4] averaged over the data-parallel ranks (every tensor-parallel rank has the same ones) and
        the expert counts summed over the data- and tensor-parallel ranks (each counted its own tokens)."""
        from moetrain.distributed.reduce import mean_over, sum_over

        m = self.meshes
        if m.ep is not None or m.tp is not None:
            from moetrain.distributed.fsdp import expert_grad_factor, expert_grad_scale, expert_params

            expert_grad_scale(expert_params(self.model), expert_grad_factor(self.ranks.tp, self.ranks.ep))
        mean_over(sums, m.dp.get_group())
        layers = self.model.moe_layers()
        if layers:
            counts = sum_over(torch.stack([layer.tokens_per_expert for layer in layers]), m.dp.get_group())
            if m.tp is not None:
                sum_over(counts, m.tp.get_group())
            for layer, c in zip(layers, counts):
                layer.tokens_per_expert.copy_(c)
        return LossTerms(sums)

    @torch.no_grad()
    def evaluate(self) -> float:
        with self.loss_context():
            return super().evaluate()

    def stop_requested(self, stop) -> bool:
        """Agreed by every rank (a signal may reach them between different steps): the save that follows is a
        collective."""
        if not self.sharded:
            return stop.requested
        import torch.distributed as dist

        flag = torch.tensor([float(stop.requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def save(self, step: int) -> None:
        """A sharded checkpoint from every rank (``train.sharded_checkpoint``); one rank saves the single-device
        format."""
        if not self.sharded:
            return super().save(step)
        from moetrain.errors import format_bytes
        from moetrain.train import sharded_checkpoint as sc
        from moetrain.train.loop_support import refuse_non_finite

        state = sc.checkpoint_state(self.model, self.optimizer)
        local = sc.local_view(state)
        mine = None
        try:
            refuse_non_finite(local["model"], local["optimizer"], step, self.out_dir)
        except UserError as err:
            mine = str(err)
        message = sc.first_error(sc.gather(mine))
        if message is not None:
            raise UserError(message)
        saved = sc.save_sharded(self.out_dir, step, state=state, trainer_state=self.trainer_state(step),
                                config_yaml=self.config_yaml, run_id=self.start.run_id,
                                layout=dataclasses.asdict(self.ranks), keep_last=self.cfg.checkpoint.keep_last)
        self.display.log(f"saved checkpoint {saved.path} ({format_bytes(saved.bytes)} from {self.gpus} ranks in "
                         f"{saved.seconds:.1f} s)")

    def run(self):
        import torch.distributed as dist

        result = super().run()
        # Destroyed after a clean run only: after a failure the group stays up for the error report (the first
        # failing rank claims it in the group's store, ``distributed.faults``) and dies with the process.
        if self.made_group and dist.is_initialized():
            dist.destroy_process_group()
        return result

    def choose_device(self) -> torch.device:
        """cuda:LOCAL_RANK, or the CPU (``distributed.launch.device_for``), chosen before the process group."""
        return self._device
