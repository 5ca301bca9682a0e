"""DTensor tensor parallelism on our modules (2 gloo ranks, CPU, fp64): ``parallelize_module`` with
ColwiseParallel on the input projections and RowwiseParallel on the output projection gives the
unsharded module's output and, gathered, its gradients.

What the sharding styles do not cover, and a TP plan must add (the tests add it and check the
result): the GQA q/k norm weights [hd] act on a rank's own heads, so their gradients are per-rank
parts that sum to the whole (reduce them over the TP group);
MLA's shared rope key (the last qk_rope_head_dim columns of kv_a_proj's output, replicated) is
consumed by each rank's heads, so its gradient must be all-reduced before it reaches kv_a_proj.
MLA's other replicated parts (q_a_proj, q_a_norm, the latent columns, kv_a_norm) feed a
column-parallel projection, whose input gradient DTensor all-reduces: they need nothing.
"""

import torch
import torch.distributed as dist
from gloo_ranks import cpu_mesh, full, run_ranks
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from moetrain.config.schema import Config
from moetrain.models.attention import GQAAttention, MLAttention
from moetrain.models.mlp import MLP

B, S = 2, 6


def randomized(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return module


def twin(ref: nn.Module, build) -> nn.Module:
    """A second module with ref's weights (the one that gets sharded)."""
    other = build().double()
    other.load_state_dict(ref.state_dict())
    return other


def run_both(ref, tp, seed, *extra):
    """Forward and backward of ref and tp on the same input x [B, S, H] (fp64, with grad); returns (x_ref, x_tp, y_tp)."""
    H = next(ref.parameters()).shape[-1] if isinstance(ref, MLP) else ref.o_proj.out_features
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    y_ref, y_tp = ref(x_ref, *extra), tp(x_tp, *extra)
    torch.testing.assert_close(torch.as_tensor(y_tp), y_ref, rtol=1e-12, atol=1e-12)
    y_ref.backward(dy)
    y_tp.backward(dy)
    torch.testing.assert_close(x_tp.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    return y_tp


def assert_grads(ref: nn.Module, tp: nn.Module, summed: tuple[str, ...] = ()) -> None:
    """Gathered gradients equal ref's; those named in ``summed`` (replicated, per-rank parts) after an all-reduce."""
    tp_params = dict(tp.named_parameters())
    for name, p in ref.named_parameters():
        grad = full(tp_params[name].grad)
        if name in summed:
            grad = grad.clone()
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)


def _mlp_ranks(rank, world_size):
    mesh = cpu_mesh(world_size)
    for activation in ("swiglu", "swiglu_clamped", "gelu"):
        build = lambda activation=activation: MLP(16, 12, activation)
        ref = randomized(build().double(), 1)
        tp = twin(ref, build)
        plan = {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        if activation != "gelu":
            plan["gate_proj"] = ColwiseParallel()
        parallelize_module(tp, mesh, plan)
        assert isinstance(tp.up_proj.weight, DTensor) and tp.up_proj.weight.placements == (Shard(0),)
        assert tp.up_proj.weight.to_local().shape == (12 // world_size, 16)
        if activation != "gelu":
            # this rank's gate rows and up rows are the same intermediate units
            rows = slice(rank * 6, (rank + 1) * 6)
            assert torch.equal(tp.gate_proj.weight.to_local(), ref.gate_proj.weight[rows])
            assert torch.equal(tp.up_proj.weight.to_local(), ref.up_proj.weight[rows])
        run_both(ref, tp, seed=2)
        assert_grads(ref, tp)


def test_mlp_colwise_gate_up_rowwise_down():
    run_ranks(_mlp_ranks)


def _attention_cfg(kind: str) -> Config:
    cfg = Config()
    m = cfg.model
    if kind == "mla":
        m.attention_type, m.hidden_size, m.num_attention_heads = "mla", 16, 4
        m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 10, 8, 4, 4, 6
    else:
        m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim = 16, 4, 2, 6
        m.attention_bias, m.qk_norm = True, True
        m.attention_sinks = kind == "gqa_sinks"
    return cfg


class _AllReduceGradColumns(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's columns from ``start`` on."""

    @staticmethod
    def forward(ctx, t, start):
        ctx.start = start
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        part = grad[..., ctx.start:].contiguous()
        dist.all_reduce(part)
        grad[..., ctx.start:] = part
        return grad, None


def _attention_ranks(rank, world_size, kind):
    mesh = cpu_mesh(world_size)
    cfg = _attention_cfg(kind)
    window = 3 if kind == "gqa_sinks" else None
    build = (lambda: MLAttention(cfg)) if kind == "mla" else (lambda: GQAAttention(cfg, window))
    ref = randomized(build().double(), 3)
    tp = twin(ref, build)
    if kind == "mla":
        plan = {"q_b_proj": ColwiseParallel(), "kv_b_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
        summed = ()
        kvl = cfg.model.kv_lora_rank
        tp.kv_a_proj.register_forward_hook(lambda mod, args, out: _AllReduceGradColumns.apply(out, kvl))
    else:
        plan = {p: ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")} | {"o_proj": RowwiseParallel()}
        summed = ("q_norm.weight", "k_norm.weight")
    parallelize_module(tp, mesh, plan)
    heads = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)  # this rank's query heads
    if kind == "gqa_sinks":  # one sink per query head: the plan gives a rank its heads' sinks
        tp.sinks = nn.Parameter(ref.sinks.detach()[heads].clone())
    cos, sin = ref.rope.tables(S)
    run_both(ref, tp, 4, cos, sin)
    if kind == "gqa_sinks":
        torch.testing.assert_close(tp.sinks.grad, ref.sinks.grad[heads], rtol=1e-12, atol=1e-12)
        ref.sinks = None  # compared here, by this rank's slice
    assert_grads(ref, tp, summed)


def test_gqa_attention_colwise_qkv_rowwise_o():
    """Biases and q/k norms; 4 query heads and 2 kv heads: 2 and 1 per rank."""
    run_ranks(_attention_ranks, "gqa")


def test_gqa_attention_with_sinks_and_window():
    run_ranks(_attention_ranks, "gqa_sinks")


def test_mla_attention_colwise_q_b_kv_b_rowwise_o():
    run_ranks(_attention_ranks, "mla")
