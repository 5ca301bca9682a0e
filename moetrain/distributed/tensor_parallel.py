"""Tensor parallelism (TP), with or without sequence parallelism (SP), for ``MoETransformer`` on DTensor.

Legend: B batch, S sequence, H hidden, V vocab, tp ranks of the tp mesh, nh query heads, nkv kv heads.

``apply_tensor_parallel(model, tp_mesh, sequence_parallel=...)`` makes a whole model, or one pipeline stage
(``keep_only``: embedding, final norm and head may be absent, MTP depths only on the last stage), tensor-parallel over
the 1-D ``tp_mesh`` with torch's ``parallelize_module`` styles. Every rank of the mesh is given the same micro-batch.

Between blocks: plain tensors. Every decoder block (and MTP depth) takes and returns a plain tensor: this rank's
sequence slice h [B, S/tp, H] with SP, the whole h [B, S, H] (the same on every rank) without. Pipeline stages send
exactly these; ``model.seq_shards`` (= tp with SP) lets a stage without the embedding build RoPE tables for the whole
sequence from its [B, S/tp, H] input.

What is split, per block (styles from ``torch.distributed.tensor.parallel``):
- attention: q/k/v projections ColwiseParallel (MLA: q_b_proj or q_proj, kv_b_proj), o_proj RowwiseParallel; each
  rank computes nh/tp query heads with their nkv/tp kv heads. GQA's input is prepared as one DTensor (all-gathered
  under SP), so its backward reduces once (all-reduce, or reduce-scatter under SP). GQA sinks [nh]: Shard(0) like
  the heads. GQA q/k norms act on a rank's own heads: SequenceParallel on the head dim (2), their weight gradients
  come back Partial. MLA: the down projections (q_a_proj, kv_a_proj) and their norms stay plain replicated modules on
  the whole sequence (gathered under SP); the column-parallel q_b/kv_b projections all-reduce their input
  gradients, and the shared rope key (kv_a_proj's last qk_rope_head_dim output columns), read by every rank's own
  heads, has its gradient all-reduced over tp by a hook on kv_a_proj (``_SumGradColumns``).
- dense MLP and MoE shared experts: gate/up ColwiseParallel, down RowwiseParallel.
- norms: SequenceParallel under SP (the pre-attention / pre-MLP norms, MTP's enorm/hnorm/eh_proj); plain otherwise.
- MoE routed experts: not split (expert tensor parallelism stays refused). Each tp rank routes and computes its own
  slice of every sequence (``SequenceSplit`` as ``MoELayer.token_split`` / ``Router.token_split``): with SP its input
  is that slice; without, it takes its slice of the replicated input (no communication) and all-gathers the routed
  output (whose backward hands each rank its slice's gradient). The shared expert runs on the whole sequence as a TP
  MLP. The balancing and z losses are this rank's parts of the whole batch's (one all-reduce of the counts,
  probability sums and z sum per layer, ``models.moe.router``); ``MoELayer.aux_value`` is the whole value on every
  rank. The router weights: ``replicate_local`` (Replicate DTensors, seen as local tensors in forward, gradients
  Partial).
- embedding: RowwiseParallel (vocab-parallel), output Shard(1) under SP. Output head: ColwiseParallel (vocab-sharded
  logits); the final norms (the model's, each MTP depth's) return a Replicate DTensor so the head (or the tied
  embedding weight, also Shard(0) over V) gives logits Shard(-1) and the cross-entropy (LM, MTP, -100 ignored)
  runs vocab-parallel under ``loss_parallel``. The model's output is made plain again (``_plain_outputs``): the
  loss terms (the same value on every rank), or full logits without labels.

Per rank, not per sequence (as with data parallelism): moe.capacity_factor caps the assignments of this rank's
tokens, and force_balance=even cycles over this rank's tokens.

The trainer's contract (dp: data-parallel ranks, ep: expert parallelism):
0. Meshes and order: tp is the innermost dim of one root mesh that the dp (FSDP) meshes and the ep mesh also come
   from; every tp rank of a dp rank reads the same micro-batch. On the meta model: ``apply_tensor_parallel`` first,
   then ``shard_experts`` (ep mesh), recompute, FSDP2 (``fully_shard`` per block over the dense dp mesh, the experts
   their own unit over the expert FSDP mesh, the root), then ``to_empty`` and ``init_weights`` (or the HF import).
1. Every forward (training and evaluation) and backward of a loss runs inside ``tp_loss_context(model)`` (torch's
   ``loss_parallel``; a no-op without TP).
2. Parameters replicated over tp whose gradient is each rank's part (SP norms, MTP eh_proj under SP, GQA q/k norms,
   routers) are Replicate DTensors on the tp mesh whose gradients are Partial DTensors. FSDP2 redistributes them to
   Replicate (an all-reduce over tp) before its reduce-scatter: nothing more to do. Without FSDP call
   ``reduce_tp_grads(model)``.
3. Expert weights (plain tensors, or ep DTensors) are not tp DTensors; each rank's gradient holds its tokens' part.
   The step's gradient is (1/dp) * the sum over all dp x tp ranks' parts. With the experts an FSDP unit of their own
   over the expert FSDP mesh (efsdp = dp x tp / ep ranks; FSDP averages over it) and the ep all-to-all summing an ep
   group's tokens, multiply the expert gradients by tp / ep after the reduce (``fsdp.expert_grad_factor``; tp = 1 gives
   today's 1 / ep). Experts inside a block's FSDP unit over dp (ep = 1) would instead need a sum over tp (all-reduce)
   of the reduced shard. Without FSDP (tp only, ep = 1 or ep over the tp ranks): ``reduce_tp_grads``.
4. ``tokens_per_expert`` counts each rank's tokens: sum them over tp and dp before the expert-bias update.
5. Loss terms (``ModelOutput``) are the same on every tp rank: average them over dp only. Gradient norms: the
   Replicate parameters count once (``distributed.reduce.shard_groups`` sees no tp shard).

Nothing here runs at import: torch.distributed is imported by the functions that need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

import torch
from torch import nn

from moetrain.config.relations import check_tensor_parallel


def apply_tensor_parallel(model, tp_mesh, *, sequence_parallel: bool) -> None:
    """Make ``model`` (an ``MoETransformer``, whole or one pipeline stage, on any device incl. meta) tensor-parallel
    over the 1-D DeviceMesh ``tp_mesh`` (see the module doc), in place. Raises ConfigError for sizes tp does not
    divide. Parameters it splits or replicates become DTensors on ``tp_mesh``; the experts stay as they are."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp, sp = tp_mesh.size(), sequence_parallel
    check_tensor_parallel(model.cfg, tp)
    if model.embed is not None:
        parallelize_module(model.embed, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()))
    for _, block in model.blocks():
        parallelize_block(block, tp_mesh, sequence_parallel=sp)
    for depth in model.mtp.values():
        if sp:
            from torch.distributed.tensor.parallel import SequenceParallel

            parallelize_module(depth, tp_mesh, {"enorm": SequenceParallel(), "hnorm": SequenceParallel(),
                                                "eh_proj": SequenceParallel(use_local_output=True)})
        _parallelize_loss_norm(depth.final_norm, tp_mesh, sp)
    if model.final_norm is not None:
        _parallelize_loss_norm(model.final_norm, tp_mesh, sp)
    if model.head is not None:  # its weight only: _logits calls F.linear on it
        parallelize_module(model.head, tp_mesh, ColwiseParallel(use_local_output=False))
    model.seq_shards = tp if sp else 1
    model.tp_mesh = tp_mesh
    if model.cfg.train.fused_loss:  # else the logits are vocab-sharded DTensors and the loss runs under loss_parallel
        model.token_loss = vocab_parallel_token_loss
    model.register_forward_hook(_plain_outputs)


def parallelize_block(block, mesh, *, sequence_parallel: bool) -> None:
    """One ``DecoderLayer`` (a decoder layer or an MTP depth's block): attention, dense MLP or MoE layer, norms. It
    then takes and returns this rank's h [B, S/tp, H] under SP, the whole h [B, S, H] without (module doc)."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    sp = sequence_parallel
    plan = {}
    if sp:
        plan["input_norm"] = SequenceParallel()
        # the MoE layer takes its slice as a plain tensor; the dense MLP a DTensor it all-gathers once
        plan["post_attn_norm"] = SequenceParallel(use_local_output=block.is_moe)
    plan.update(_attention_plan(block.attn, sp))
    if not block.is_moe:
        plan.update(_mlp_plan(block.mlp, "mlp", sp))
    elif block.mlp.shared is not None:
        plan.update(_mlp_plan(block.mlp.shared, "mlp.shared", sp))
    parallelize_module(block, mesh, plan)
    _finish_attention(block.attn, mesh)
    if block.is_moe:
        replicate_local(block.mlp.router, mesh)
        split = SequenceSplit(mesh, gathered=not sp)
        block.mlp.token_split = block.mlp.router.token_split = split


def tp_loss_context(model):
    """The context the trainer wraps around forward and backward: torch's ``loss_parallel`` (vocab-parallel
    cross-entropy on the vocab-sharded logits) for a tensor-parallel ``model``, else a no-op."""
    if getattr(model, "tp_mesh", None) is None:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


@torch.no_grad()
def reduce_tp_grads(model) -> None:
    """Without FSDP: sum over tp what each rank holds a part of (contract 2 and 3): Partial DTensor gradients are
    redistributed to their parameter's placements, the gradients of expert weights that are plain tensors are
    all-reduced over ``model.tp_mesh``. Expert DTensors (expert parallelism) are left as they are: their ep group
    must be the tp ranks, whose all-to-all already summed every rank's tokens."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(placements=p.placements)
    group = model.tp_mesh.get_group()
    for layer in model.moe_layers():
        for p in layer.experts.parameters():
            if p.grad is not None and not isinstance(p, DTensor):
                dist.all_reduce(p.grad, group=group)


# ---- the plan's parts ------------------------------------------------------------------------------------------


def _seq(sp: bool):
    """The layout of activations between modules: this rank's sequence slice under SP, else the whole (replicated)."""
    from torch.distributed.tensor import Replicate, Shard

    return Shard(1) if sp else Replicate()


def _attention_plan(attn, sp: bool) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from moetrain.models.attention import MLAttention

    plan = {"attn.o_proj": RowwiseParallel(output_layouts=_seq(sp))}
    if isinstance(attn, MLAttention):
        plan["attn.q_proj" if attn.q_proj is not None else "attn.q_b_proj"] = ColwiseParallel()
        plan["attn.kv_b_proj"] = ColwiseParallel()
        if sp:  # gathered into a plain tensor: the down projections run on the whole sequence (module doc)
            plan["attn"] = PrepareModuleInput(input_layouts=(_seq(sp), None, None),
                                              desired_input_layouts=(Replicate(), None, None), use_local_output=True)
        return plan
    plan["attn"] = PrepareModuleInput(input_layouts=(_seq(sp), None, None),
                                      desired_input_layouts=(Replicate(), None, None), use_local_output=False)
    for name in ("q_proj", "k_proj", "v_proj"):
        plan[f"attn.{name}"] = ColwiseParallel()
    if attn.q_norm is not None:  # per head: this rank's heads are dim 2 of [B, S, nh/tp, hd]
        plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _mlp_plan(mlp, prefix: str, sp: bool) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan = {prefix: PrepareModuleInput(input_layouts=(_seq(sp),), desired_input_layouts=(Replicate(),),
                                       use_local_output=False),
            f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel(output_layouts=_seq(sp))}
    if mlp.gate_proj is not None:
        plan[f"{prefix}.gate_proj"] = ColwiseParallel()
    return plan


def _finish_attention(attn, mesh) -> None:
    """What the styles do not cover: GQA sinks sharded like the heads, MLA's shared rope key gradient summed."""
    from moetrain.models.attention import MLAttention

    if isinstance(attn, MLAttention):
        attn.kv_a_proj.register_forward_hook(partial(_sum_rope_key_grad, attn.kvl, mesh.get_group()))
    elif attn.sinks is not None:
        attn.sinks = nn.Parameter(_shard_dim0(attn.sinks, mesh), requires_grad=attn.sinks.requires_grad)
        _see_local_params(attn, {"sinks": None})


def _parallelize_loss_norm(norm, mesh, sp: bool) -> None:
    """A final norm feeding the vocab-parallel head: its output becomes the whole sequence as a Replicate DTensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel, parallelize_module

    if sp:
        parallelize_module(norm, mesh, SequenceParallel())
    parallelize_module(norm, mesh, PrepareModuleOutput(output_layouts=Shard(1) if sp else Replicate(),
                                                       desired_output_layouts=Replicate(), use_local_output=False))


def vocab_parallel_token_loss(normed, weight, labels: torch.Tensor) -> torch.Tensor:
    """``MoETransformer.token_loss`` under TP: normed a Replicate DTensor [B, S, H] (the whole sequence on every
    rank), weight a Shard(0) DTensor [V, H] (the head, or the tied embedding); the fused loss runs on this rank's
    vocabulary rows, the log-sum-exp combined over the tp ranks per chunk and dh all-reduced (so the local
    gradient is the Replicate one). Every rank passes the same chunk size: the collectives must line up, and the
    default follows the rows held, which the last rank has fewer of. A plain fp32 [] mean, the same on every rank."""
    from moetrain.ops.linear_cross_entropy import default_chunk_tokens, kernels_run_here, linear_cross_entropy_mean

    mesh = weight.device_mesh
    rows = -(-weight.shape[0] // mesh.size())  # Shard(0): ceil(V / tp) rows per rank, the last fewer
    x = normed.to_local()
    H = x.shape[-1]
    return linear_cross_entropy_mean(x.reshape(-1, H), weight.to_local(), labels.reshape(-1),
                                     vocab_group=mesh.get_group(), vocab_start=mesh.get_local_rank() * rows,
                                     chunk_tokens=default_chunk_tokens(rows, x.dtype, kernels_run_here(x)))


def _plain_outputs(model, args, out):
    """The root's forward hook: plain tensors out. The loss terms are Replicate scalars (to_local is the value); logits
    without labels are gathered over the vocab; h from a stage of only the embedding is, under SP, the reduce-scatter's
    AsyncCollectiveTensor, copied into a plain tensor (a pipeline stage sends plain tensors; ops on it would unwrap it,
    but the stage has none)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    from moetrain.models.transformer import ModelOutput

    if isinstance(out, ModelOutput):
        return dataclasses.replace(out, **{f.name: _local(getattr(out, f.name)) for f in dataclasses.fields(out)})
    if isinstance(out, AsyncCollectiveTensor):
        return out.clone()
    return out.full_tensor() if isinstance(out, DTensor) else out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# ---- what no torch style does ----------------------------------------------------------------------------------


class SequenceSplit:
    """The MoE layers' token split over the tp ranks (``MoELayer.token_split`` and ``Router.token_split``): rank r
    routes positions [r S/tp, (r+1) S/tp) of every sequence. ``gathered``: the layer's input holds the whole sequence
    (no SP), so ``local`` takes this rank's slice and ``whole`` all-gathers the routed output; under SP both are the
    identity. ``parts`` = tp; ``sum_`` all-reduces (sums) a tensor over tp, in place, outside autograd."""

    def __init__(self, mesh, gathered: bool):
        self.mesh, self.parts, self.gathered = mesh, mesh.size(), gathered

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] (the same on every rank) -> [B, S/tp, H], this rank's positions; backward all-gathers."""
        if not self.gathered:
            return x
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if x.shape[1] % self.parts:
            raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor parallelism {self.parts}: "
                             "the MoE layers split each sequence over the tp ranks")
        d = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return d.redistribute(self.mesh, [Shard(1)]).to_local()

    def whole(self, y: torch.Tensor) -> torch.Tensor:
        """y [B, S/tp, H], this rank's positions -> [B, S, H] all-gathered; backward keeps this rank's slice."""
        if not self.gathered:
            return y
        from torch.distributed.tensor import DTensor, Replicate, Shard

        d = DTensor.from_local(y, self.mesh, [Shard(1)], run_check=False)
        return d.redistribute(self.mesh, [Replicate()]).to_local()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.mesh.get_group())
        return t


def replicate_local(module: nn.Module, mesh) -> None:
    """For a module whose weights are replicated over tp but which computes on this rank's own tokens (the MoE router):
    its parameters become Replicate DTensors, and during its forward the module sees their local tensors, whose
    gradients return as Partial (this rank's tokens' part), which FSDP2 or ``reduce_tp_grads`` sums over tp. Inputs
    and outputs stay plain tensors: torch's styles compute on DTensors, which the router's custom ops do not take
    (torchtitan's NoParallel is the DTensor-computing analogue)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    names = [name for name, _ in module.named_parameters(recurse=False)]
    for name in names:
        p = getattr(module, name)
        d = DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)
        module.register_parameter(name, nn.Parameter(d, requires_grad=p.requires_grad))
    _see_local_params(module, {name: (Partial(),) for name in names})


def _see_local_params(module: nn.Module, grad_placements: dict) -> None:
    """During ``module``'s forward, each named DTensor parameter is shadowed by its local tensor
    (``to_local(grad_placements=...)``; None: the parameter's own placements), so model code written for plain tensors
    runs unchanged; the gradients reach the DTensor parameter. The shadow is an instance attribute (Python finds it
    before nn.Module's parameter lookup), removed after the forward; FSDP2's unsharded parameter, set into
    ``_parameters`` before this module runs, is the one shadowed."""

    def pre(mod, args):
        for name, placements in grad_placements.items():
            p = mod._parameters[name]
            mod.__dict__[name] = p.to_local(grad_placements=placements) if hasattr(p, "to_local") else p

    def post(mod, args, out):
        for name in grad_placements:
            mod.__dict__.pop(name, None)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)


def _shard_dim0(p: torch.Tensor, mesh):
    """p (global, the same on every rank; meta allowed) -> a DTensor Shard(0) over ``mesh`` holding this rank's rows."""
    from torch.distributed.tensor import DTensor, Shard

    local = p.detach().chunk(mesh.size(), dim=0)[mesh.get_local_rank()]
    local = local if local.is_meta else local.clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())


class _SumGradColumns(torch.autograd.Function):
    """Identity forward; backward sums the gradient's last-dim columns from ``start`` on over ``group``."""

    @staticmethod
    def forward(ctx, t, start, group):
        ctx.start, ctx.group = start, group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        part = grad[..., ctx.start:].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.start:] = part
        return grad, None, None


def _sum_rope_key_grad(kvl: int, group, module, args, out):
    """kv_a_proj's forward hook: out [B, S, kvl + rope] = [latent | shared rope key]; the rope key feeds every rank's
    own heads, so its gradient is summed over tp (the latent's comes whole from kv_b_proj's input all-reduce)."""
    return _SumGradColumns.apply(out, kvl, group)
