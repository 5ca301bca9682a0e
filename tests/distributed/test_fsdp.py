"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on our modules, 2 gloo ranks, CPU, fp64: data
parallel over the two ranks' own batches gives each rank the unsharded module's loss on its batch,
and the gathered gradients equal those of the mean of both ranks' losses on one unsharded copy."""

import pytest
import torch
from gloo_ranks import cpu_mesh, full, run_ranks
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from moetrain.config.schema import Config
from moetrain.models.attention import GQAAttention, MLAttention
from moetrain.models.mlp import MLP

B, S, H = 2, 5, 16


def _build(kind: str):
    if kind == "mlp":
        return MLP(H, 24, "swiglu")
    cfg = Config()
    m = cfg.model
    m.hidden_size, m.num_attention_heads = H, 4
    if kind == "mla":
        m.attention_type, m.q_lora_rank, m.kv_lora_rank = "mla", 8, 8
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 4, 4, 6
        return MLAttention(cfg)
    m.num_query_groups, m.head_dim, m.attention_bias, m.qk_norm, m.attention_sinks = 2, 6, True, True, True
    return GQAAttention(cfg, window=3)


def _loss(module, x, extra):
    return module(x, *extra).square().mean()


def _fsdp_ranks(rank, world_size, kind):
    mesh = cpu_mesh(world_size)
    torch.manual_seed(0)  # the same weights on every rank
    ref = _build(kind).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    sharded = _build(kind).double()
    sharded.load_state_dict(ref.state_dict())
    fully_shard(sharded, mesh=mesh)
    for p in sharded.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),)

    xs = torch.randn(world_size, B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    extra = () if kind == "mlp" else ref.rope.tables(S)
    loss = _loss(sharded, xs[rank], extra)
    torch.testing.assert_close(loss, _loss(ref, xs[rank], extra), rtol=1e-13, atol=0)
    loss.backward()
    # FSDP averages the ranks' gradients: the gradient of the mean loss over both batches
    torch.stack([_loss(ref, x, extra) for x in xs]).mean().backward()
    got = dict(sharded.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full(got[name].grad), p.grad, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("kind", ["mlp", "gqa", "mla"])
def test_fully_shard_matches_unsharded(kind):
    run_ranks(_fsdp_ranks, kind)
