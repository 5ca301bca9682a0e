"""MoE layer against a naive per-token float64 loop; expert-bias update; load statistics."""

import math

import pytest
import torch

from moetrain.config.schema import Config
from moetrain.models.moe.layer import MoELayer
from moetrain.models.transformer import MoETransformer


def moe_cfg(**moe):
    cfg = Config()
    cfg.model.hidden_size = 16
    cfg.moe.num_experts, cfg.moe.topk, cfg.moe.moe_ffn_hidden_size = 6, 2, 8
    for key, value in moe.items():
        setattr(cfg.moe, key, value)
    return cfg


def random_init(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def act(h, activation):
    gate, up = h.chunk(2)
    if activation == "swiglu":
        return gate * torch.sigmoid(gate) * up
    gate = torch.clamp(gate, max=7.0)
    up = torch.clamp(up, -7.0, 7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def naive_layer(layer, x, activation):
    """For each token, for each of its k experts, run that expert's FFN; add the shared MLP."""
    r = layer.router(x)
    ex = layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(r.topk_idx.shape[1]):
            e = int(r.topk_idx[t, k])
            if e < 0:
                continue
            h = ex.w1[e] @ x[t] + (ex.b1[e] if ex.b1 is not None else 0)
            y = ex.w2[e] @ act(h, activation) + (ex.b2[e] if ex.b2 is not None else 0)
            out[t] += r.topk_weight[t, k] * y
        if layer.shared is not None:
            sh = layer.shared
            gate_up = torch.cat([sh.gate_proj.weight, sh.up_proj.weight]) @ x[t]
            out[t] += sh.down_proj.weight @ act(gate_up, activation)
    return out


@pytest.mark.parametrize("variant", ["deepseek", "gptoss", "capacity"])
def test_moe_layer_matches_naive_loop_fp64(variant):
    if variant == "deepseek":
        cfg = moe_cfg(score_function="sigmoid", num_groups=3, topk_groups=2, expert_bias=True,
                      num_shared_experts=1, scaling_factor=2.5)
    elif variant == "gptoss":
        cfg = moe_cfg(router_bias=True, expert_linear_bias=True, activation="swiglu_clamped", topk=3)
    else:
        cfg = moe_cfg(capacity_factor=0.6)
    layer = MoELayer(cfg).double()
    random_init(layer, seed=1)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 6))
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = layer(x)
    ref = naive_layer(layer, x.reshape(14, 16), cfg.moe.activation).view(2, 7, 16)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    if variant == "capacity":
        r = layer.router(x.reshape(14, 16))
        per_expert = torch.bincount(r.topk_idx[r.topk_idx >= 0], minlength=6)
        assert per_expert.max() <= math.ceil(0.6 * 14 * 2 / 6) and (r.topk_idx < 0).any()


def test_aux_terms_weighted_by_coefficients():
    cfg = moe_cfg(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    layer = MoELayer(cfg)
    random_init(layer, seed=3)
    x = torch.randn(2, 5, 16)
    layer(x)
    aux = layer.aux_value
    r = layer.router(x.reshape(10, 16))
    assert aux.item() == pytest.approx(0.01 * r.aux_loss.item() + 0.001 * r.z_loss.item(), rel=1e-6)
    assert r.aux_loss.item() > 0 and r.z_loss.item() > 0


def test_losses_that_are_off_share_one_zero_and_the_model_sums_the_layers_once():
    """A loss that is off is one shared zero (no allocation and fill per layer call); the model's aux is the sum of
    its MoE layers' terms, taken in one stack and sum (not an add per layer)."""
    from moetrain.models.moe.router import zero_loss

    cfg = moe_cfg(aux_loss_coeff=0.01, z_loss_coeff=0.0)
    layer = MoELayer(cfg)
    random_init(layer, seed=3)
    x = torch.randn(10, 16)
    r1, r2 = layer.router(x), layer.router(x)
    assert r1.z_loss is r2.z_loss is zero_loss(x.device) and r1.z_loss.item() == 0.0
    assert r1.aux_loss.item() > 0

    cfg = moe_cfg(aux_loss_coeff=0.01)
    cfg.model.num_layers, cfg.moe.first_k_dense, cfg.model.vocab_size = 4, 1, 64
    model = MoETransformer(cfg)
    random_init(model, seed=4)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(5))
    out = model(ids, ids)
    moe_terms = [blk.aux_value() for blk in model.layers.values() if blk.is_moe]
    assert len(moe_terms) == 3 and all(blk.aux_value() is None for blk in model.layers.values() if not blk.is_moe)
    torch.testing.assert_close(out.aux_loss, torch.stack(moe_terms).sum())
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss)


def test_update_expert_bias_moves_against_load():
    cfg = moe_cfg(num_experts=4, expert_bias=True)
    layer = MoELayer(cfg)
    layer.router.expert_bias.zero_()
    layer.tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))  # mean 5
    layer.update_expert_bias(0.1)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    assert layer.load_imbalance().item() == pytest.approx(2.0)
    assert layer.tokens_per_expert.tolist() == [10.0, 0.0, 5.0, 5.0]  # kept until reset
    layer.reset_stats()
    assert layer.tokens_per_expert.tolist() == [0.0] * 4


def test_expert_bias_stays_fp32_under_bf16_cast():
    layer = MoELayer(moe_cfg(expert_bias=True))
    layer.router.expert_bias.fill_(1e-3)
    layer.to(torch.bfloat16)
    assert layer.experts.w1.dtype == torch.bfloat16
    assert layer.router.expert_bias.dtype == torch.float32
    assert torch.equal(layer.router.expert_bias, torch.full((6,), 1e-3))  # not rounded through bf16
    assert layer.tokens_per_expert.dtype == torch.float32


def tiny_moe_model(**train):
    cfg = moe_cfg(expert_bias=True, num_experts=4)
    cfg.model.vocab_size, cfg.model.num_layers, cfg.model.num_attention_heads = 64, 2, 2
    cfg.model.mtp_num_layers = 1
    for key, value in train.items():
        setattr(cfg.train, key, value)
    torch.manual_seed(0)
    return MoETransformer(cfg)


def test_counts_accumulate_over_micro_batches_and_not_on_recompute():
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    plain, full = tiny_moe_model(), tiny_moe_model(recompute="full")
    for model in (plain, full):
        for _ in range(2):  # two micro-batches
            model(ids, ids).loss.backward()
    for a, b in zip(plain.moe_layers(), full.moe_layers()):
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)
        # every token makes K = 2 assignments per micro-batch
        assert a.tokens_per_expert.sum().item() == 2 * 16 * 2
    assert len(plain.moe_layers()) == 3  # 2 decoder layers + the MTP block
    before = [m.router.expert_bias.clone() for m in plain.moe_layers()]
    plain.update_expert_bias(0.5)
    for m, b in zip(plain.moe_layers(), before):
        c = m.tokens_per_expert
        assert torch.equal(m.router.expert_bias - b, 0.5 * torch.sign(c.mean() - c))
    plain.reset_moe_stats()
    assert all(m.tokens_per_expert.sum() == 0 for m in plain.moe_layers())
    plain.eval()
    with torch.no_grad():
        plain(ids)
    assert all(m.tokens_per_expert.sum() == 0 for m in plain.moe_layers())  # eval does not count


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_aux_loss_gradients_through_autograd_equal_adding_the_losses(recompute):
    """The layer returns y alone; its weighted aux + z losses reach the router through autograd with gradient
    aux_grad_scale: the same gradients as adding scale * aux to the loss (the old (y, aux) path)."""
    cfg = moe_cfg(aux_loss_coeff=0.03, z_loss_coeff=0.002, score_function="sigmoid", num_shared_experts=1)
    layer = MoELayer(cfg).double()
    random_init(layer, seed=7)
    layer.recompute_experts = recompute == "selective"
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    probe = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    scale = 0.25

    def grads(loss_of):
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        loss_of(leaf).backward()
        return [leaf.grad] + [p.grad.clone() for p in layer.parameters()]

    layer.aux_grad_scale = scale
    new = grads(lambda leaf: scale * (layer(leaf) * probe).sum())

    def old(leaf):
        y, aux = layer.forward_with_aux(leaf)
        return scale * ((y * probe).sum() + aux)

    ref = grads(old)
    assert layer.router.weight.grad.abs().sum() > 0
    for a, b in zip(new, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_model_aux_grad_scale_follows_the_loss_factor():
    cfg = moe_cfg(aux_loss_coeff=0.05)
    cfg.model.num_layers, cfg.moe.first_k_dense, cfg.model.vocab_size = 3, 1, 64
    model = MoETransformer(cfg).double()
    random_init(model, seed=4)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(5))

    def router_grad(factor):
        model.zero_grad(set_to_none=True)
        model.set_aux_grad_scale(factor)
        (model(ids, ids).loss * factor).backward()
        return model.layers["1"].mlp.router.weight.grad.clone()

    torch.testing.assert_close(router_grad(0.5), 0.5 * router_grad(1.0), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("variant", ["deepseek", "gptoss", "capacity"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_unfused_dispatch_composition_matches_moe_experts(variant, backend):
    """LocalDispatcher(fused=False): rows permuted and materialised, FFN on the rows with the weights travelling
    with them (or at the combine with FC2 biases), top-k sum: the same output and gradients as ops.moe_experts."""
    from moetrain.models.moe.dispatch import LocalDispatcher

    kw = {"deepseek": dict(score_function="sigmoid", num_shared_experts=1, aux_loss_coeff=0.01),
          "gptoss": dict(router_bias=True, expert_linear_bias=True, activation="swiglu_clamped", topk=3),
          "capacity": dict(capacity_factor=0.6)}[variant]
    cfg = moe_cfg(backend=backend, **kw)
    dtype = torch.float64 if backend == "reference" else torch.float32  # torch._grouped_mm has no fp64
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    layer = MoELayer(cfg).to(dtype)
    random_init(layer, seed=11)
    x = torch.randn(3, 5, 16, dtype=dtype, generator=torch.Generator().manual_seed(12))
    probe = torch.randn(3, 5, 16, dtype=dtype, generator=torch.Generator().manual_seed(13))

    def run(fused):
        layer.dispatcher = LocalDispatcher(fused=fused)
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        y = layer(leaf)
        (y * probe).sum().backward()
        return [y.detach(), leaf.grad] + [p.grad.clone() for p in layer.parameters()]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, **tol)
