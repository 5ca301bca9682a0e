"""Model-level tensor parallelism (``distributed.tensor_parallel``) on gloo CPU ranks, fp32: the tensor-parallel model
gives the single-device model's losses (LM, MTP, aux per MoE layer) and, gathered, every parameter's gradient.

Models: the tiny preset (MLA, dense first layer, MoE layers with a shared expert, sigmoid group-limited routing, MTP
1, sequence aux loss), and a GQA variant (2 kv heads, q/k norms, attention biases, sinks, tied embeddings, batch aux
loss and z loss). Recompute: selective on every block, full on one. Both without and with sequence parallelism.

A gradient is compared as a whole tensor: |got - want| <= 1e-5 |want| (Frobenius norms); fp32 reductions in another
order differ by ~1e-6 relative.
"""

import torch
from gloo_ranks import run_ranks

from moetrain.config.load import load_config

B, S = 2, 8
TOL = 1e-5
RECOMPUTE = ["train.recompute=selective", "train.recompute_layer_ids=[2]"]
TINY = RECOMPUTE
GQA = RECOMPUTE + ["model.attention_type=gqa", "model.num_query_groups=2", "model.head_dim=12", "model.qk_norm=true",
                   "model.attention_bias=true", "model.attention_sinks=true", "model.tie_embeddings=true",
                   "moe.aux_loss_type=batch", "moe.z_loss_coeff=1e-3"]


def config(overrides):
    return load_config(preset="tiny", overrides=overrides)


def batch(cfg, seed: int = 1):
    """(input_ids, labels) [B, S] int64, with ignored labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.model.vocab_size, (B, S), generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, (B, S), generator=g)
    labels[0, 3] = labels[1, 0] = -100
    return ids, labels


def build(cfg, device=None):
    from moetrain.models import build_model

    torch.manual_seed(0)  # the same base seed for every build
    return build_model(cfg, device)


def terms(out, model) -> dict:
    return {"lm": out.lm_loss, "mtp": out.mtp_loss, "aux": out.aux_loss, "loss": out.loss.detach(),
            **{f"aux{i}": layer.aux_value for i, layer in enumerate(model.moe_layers())}}


def reference(cfg, batches):
    """The single-device model on the mean loss of ``batches``: (terms of each batch, grads, MoE counts, model)."""
    model = build(cfg)
    model.set_aux_grad_scale(1 / len(batches))  # the balancing losses' share of the mean loss
    outs, each = [], []
    for ids, labels in batches:
        outs.append(model(ids, labels))
        each.append(terms(outs[-1], model))
    torch.stack([o.loss for o in outs]).mean().backward()
    counts = [layer.tokens_per_expert.clone() for layer in model.moe_layers()]
    return each, {n: p.grad for n, p in model.named_parameters()}, counts, model


def run_tp(model, ids, labels):
    from moetrain.distributed.tensor_parallel import tp_loss_context

    with tp_loss_context(model):
        out = model(ids, labels)
        got = terms(out, model)
        out.loss.backward()
    return got


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def assert_rel(got, want, what: str, tol: float = TOL):
    err = (got.double() - want.double()).norm().item()
    assert err <= tol * want.double().norm().item() + 1e-30, f"{what}: |diff| = {err:.3g}, |want| = {want.norm():.3g}"


def assert_terms(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k, w in want.items():
        if w is None:
            assert got[k] is None, k
        else:
            assert not hasattr(got[k], "to_local"), f"{k} is a DTensor"
            assert_rel(got[k], w, k)


def assert_grads(model, want: dict):
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert_rel(full(got[name].grad), g, name)


# ---- TP on 2 ranks: SP off and on, MLA and GQA, expert parallelism over the tp ranks, weights on meta --------------


def _tp_ranks(rank, world_size, hf_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from moetrain.distributed.expert_parallel import shard_experts
    from moetrain.distributed.tensor_parallel import apply_tensor_parallel, reduce_tp_grads

    root = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    cases = [(TINY, False, False), (TINY, True, False), (GQA, False, False), (GQA, True, False),
             (TINY + ["moe.dispatcher=alltoall"], True, True)]
    for overrides, sp, ep in cases:
        cfg = config(overrides)
        ids, labels = batch(cfg)
        (want,), grads, counts, ref = reference(cfg, [(ids, labels)])
        model = build(cfg)
        apply_tensor_parallel(model, root, sequence_parallel=sp)
        if ep:  # each rank owns half the experts; the ep mesh is the tp ranks
            shard_experts(model, root, cfg.moe)
        assert_same_weights(model, ref)  # parallelised after a real build: every shard keeps its values
        with torch.no_grad():  # without labels: the whole logits [B, S, V], gathered over the vocab
            assert_rel(model(ids), ref(ids), "logits")
        model.reset_moe_stats()
        assert_terms(run_tp(model, ids, labels), want)
        reduce_tp_grads(model)
        assert_grads(model, grads)
        for layer, c in zip(model.moe_layers(), counts):  # each rank counts its own tokens
            mine = layer.tokens_per_expert.clone()
            torch.distributed.all_reduce(mine)
            torch.testing.assert_close(mine, c, rtol=0, atol=0)
            assert mine.sum() == B * S * cfg.moe.topk and layer.tokens_per_expert.sum() == mine.sum() / world_size

    for overrides, sp in ((TINY, True), (GQA, False)):  # built on meta, made parallel, then materialised
        cfg = config(overrides)
        ref = build(cfg)
        model = build(cfg, "meta")
        apply_tensor_parallel(model, root, sequence_parallel=sp)
        model.to_empty(device="cpu")
        model.init_weights()
        assert_same_weights(model, ref)
        if overrides is TINY:  # and from a Hugging Face checkpoint: each rank fills its shards (rows or columns)
            from moetrain.models.hf import load_hf_weights

            load_hf_weights(model, hf_dir)
            load_hf_weights(ref, hf_dir)
            assert_same_weights(model, ref)


def test_tensor_parallel_gives_the_single_device_losses_and_gradients(tmp_path):
    from moetrain.models.hf import export_hf

    cfg = config(TINY)
    model = build(cfg)
    with torch.no_grad():  # weights unlike any seed's init
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    export_hf(model, cfg, tmp_path / "hf")
    run_ranks(_tp_ranks, str(tmp_path / "hf"))


def assert_same_weights(model, ref):
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(full(params[name]).detach(), p.detach()), name


# ---- pipeline-stage-shaped: two stages, each tensor-parallel on the same ranks, run one after the other -----------


def _stage_ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from moetrain.distributed.tensor_parallel import apply_tensor_parallel, reduce_tp_grads, tp_loss_context
    from moetrain.models.stages import split_stages

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    # the first stage only the embedding (under SP its output comes from a reduce-scatter), or two layers
    for overrides, sp, layout in ((TINY, True, "E|t*4mL"), (GQA, False, "Et*2|t*2mL")):
        cfg = config(overrides)
        ids, labels = batch(cfg)
        (want,), grads, _, _ = reference(cfg, [(ids, labels)])
        stages = split_stages(build(cfg), layout)
        for st in stages:
            apply_tensor_parallel(st, mesh, sequence_parallel=sp)
        with tp_loss_context(stages[1]):
            h = stages[0](ids)  # what the first stage sends: this rank's sequence slice under SP, else the whole
            assert type(h) is torch.Tensor and h.shape == (B, S // world_size if sp else S, cfg.model.hidden_size)
            received = h.detach().requires_grad_()
            out = stages[1](received, labels)
            got = terms(out, stages[1])
            out.loss.backward()
        h.backward(received.grad)  # the gradient the second stage sends back
        layers = stages[0].moe_layers() + stages[1].moe_layers()
        got.update({f"aux{i}": layer.aux_value for i, layer in enumerate(layers)})
        got["aux"] = stages[0].aux_value() + stages[1].aux_value()  # the last stage's loss counts its own blocks'
        got["loss"] = got["loss"] + stages[0].aux_value()
        assert_terms(got, want)
        summed = {}  # a weight two stages hold (the embedding, for MTP and the tied head) gets both gradients
        for st in stages:
            reduce_tp_grads(st)
            for name, p in st.named_parameters():
                summed[name] = summed[name] + full(p.grad) if name in summed else full(p.grad)
        assert summed.keys() == grads.keys()
        for name, g in grads.items():
            assert_rel(summed[name], g, name)


def test_tensor_parallel_pipeline_stages_give_the_single_device_losses_and_gradients():
    run_ranks(_stage_ranks)


# ---- TP2 x DP2 with FSDP2, built on meta, two micro-batches; experts an FSDP unit of their own, with and without EP


def _tp_dp_ranks(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from moetrain.distributed.expert_parallel import shard_experts
    from moetrain.distributed.fsdp import expert_grad_factor
    from moetrain.distributed.tensor_parallel import apply_tensor_parallel, tp_loss_context

    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = root["dp"], root["tp"]
    all_ranks = root["dp", "tp"]._flatten("dp_tp")
    cfg = config(TINY + ["moe.dispatcher=alltoall"])
    batches = [batch(cfg, seed) for seed in (1, 2, 3, 4)]  # dp rank r trains on micro-batches r and r + 2
    want, grads, _, ref = reference(cfg, batches)
    mine = [dp_mesh.get_local_rank(), dp_mesh.get_local_rank() + 2]
    # ep = 1: experts plain, sharded by FSDP over all dp x tp ranks (efsdp = 4); ep = 2: over the tp ranks (efsdp = 2)
    for ep, expert_fsdp in ((1, all_ranks), (2, dp_mesh)):
        model = build(cfg, "meta")
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=True)
        if ep > 1:
            shard_experts(model, tp_mesh, cfg.moe)
        for _, block in model.blocks():
            if block.is_moe:
                fully_shard(block.mlp.experts, mesh=expert_fsdp)
                register_fsdp_forward_method(block.mlp.experts, "compute_rows")
            fully_shard(block, mesh=dp_mesh)
        for depth in model.mtp.values():
            fully_shard(depth, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
        model.to_empty(device="cpu")
        model.init_weights()
        assert_same_weights(model, ref)
        model.set_aux_grad_scale(1 / len(mine))  # two micro-batches accumulated, the gradients reduced after both
        for i in mine:
            model.set_requires_gradient_sync(i == mine[-1])
            with tp_loss_context(model):
                out = model(*batches[i])
                assert_terms(terms(out, model), want[i])
                (out.loss / len(mine)).backward()
        # FSDP averaged the experts' gradients over their efsdp ranks: the factor makes them the step's gradient
        for layer in model.moe_layers():
            for p in layer.experts.parameters():
                p.grad.to_local().mul_(expert_grad_factor(tp_mesh.size(), ep))
        assert_grads(model, grads)


def test_tensor_parallel_with_fsdp_and_expert_parallelism_on_four_ranks():
    run_ranks(_tp_dp_ranks, world_size=4)
