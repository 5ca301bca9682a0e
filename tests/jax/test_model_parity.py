"""The JAX model against the torch model on the same weights: logits, every loss term and every parameter's
gradient, fp32, for each family (tests/unit/test_models.py's ``family`` configs)."""

import os
import sys

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))
from test_models import FAMILIES, batch, build, family  # noqa: E402

from moetrain.jax import convert  # noqa: E402
from moetrain.jax.model import MoETransformer  # noqa: E402

RTOL = 1e-5


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _pair(name: str, seed: int = 0, **train):
    """(torch model, JAX model with the torch model's weights); the expert biases made non-zero so the selection
    is not the scores alone."""
    tmodel = build(name, seed, **train)
    with torch.no_grad():
        for layer in tmodel.moe_layers():
            if layer.router.expert_bias is not None:
                layer.router.expert_bias.copy_(torch.randn(layer.router.expert_bias.shape) * 0.01)
            if layer.experts.b1 is not None:  # non-zero expert and attention biases exercise their paths
                layer.experts.b1.normal_(0, 0.02)
                layer.experts.b2.normal_(0, 0.02)
    jmodel = MoETransformer(tmodel.cfg, rngs=nnx.Rngs(seed))
    convert.from_torch(tmodel, jmodel)
    return tmodel, jmodel


def _jax_loss_and_grads(jmodel, ids, labels):
    def loss_fn(model):
        out = model(jnp.asarray(ids.numpy()), jnp.asarray(labels.numpy()))
        return out.loss, out

    (_, out), grads = nnx.value_and_grad(loss_fn, has_aux=True)(jmodel)
    flat = {".".join(str(p) for p in path): v[...] for path, v in nnx.to_flat_state(grads)}
    return out, flat


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_losses_and_gradients_equal_torch(name):
    tmodel, jmodel = _pair(name)
    ids, labels = batch(seed=1)
    with torch.no_grad():
        want_logits = tmodel(ids)
    got_logits = jmodel(jnp.asarray(ids.numpy()))
    assert _rel(got_logits, want_logits.numpy()) < RTOL

    out = tmodel(ids, labels)
    out.loss.backward()
    got, grads = _jax_loss_and_grads(jmodel, ids, labels)
    for term in ("loss", "lm_loss", "aux_loss", "mtp_loss"):
        want = getattr(out, term)
        if want is None:
            assert getattr(got, term) is None
            continue
        assert abs(float(getattr(got, term)) - float(want)) <= RTOL * max(abs(float(want)), 1e-3), term
    torch_grads = {k: p.grad for k, p in tmodel.named_parameters()}
    assert set(grads) == set(torch_grads)
    bad = {k: _rel(grads[k], g.numpy()) for k, g in torch_grads.items() if _rel(grads[k], g.numpy()) > RTOL}
    assert not bad, bad


def test_deepseek_v2_routing_and_full_rank_query_equal_torch():
    """DeepSeek-V2's differences from V3: softmax scores, groups ranked by their max, no query LoRA, no MTP."""
    cfg = family("deepseek")
    m, e = cfg.model, cfg.moe
    m.q_lora_rank, m.mtp_num_layers = None, 0
    e.score_function, e.group_score, e.expert_bias, e.aux_loss_type = "softmax", "max", False, "batch"
    e.z_loss_coeff = 1e-3
    cfg.check()
    from moetrain.models.transformer import MoETransformer as TorchModel

    torch.manual_seed(4)
    tmodel = TorchModel(cfg)
    jmodel = MoETransformer(cfg, rngs=nnx.Rngs(0))
    convert.from_torch(tmodel, jmodel)
    ids, labels = batch(seed=5)
    out = tmodel(ids, labels)
    out.loss.backward()
    got, grads = _jax_loss_and_grads(jmodel, ids, labels)
    assert abs(float(got.loss) - float(out.loss)) <= RTOL * float(out.loss)
    assert max(_rel(grads[k], p.grad.numpy()) for k, p in tmodel.named_parameters()) < RTOL


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_gradients(mode):
    _, plain = _pair("deepseek")
    _, recomputed = _pair("deepseek", recompute=mode)
    ids, labels = batch(seed=2)
    _, want = _jax_loss_and_grads(plain, ids, labels)
    _, got = _jax_loss_and_grads(recomputed, ids, labels)
    assert all(_rel(got[k], want[k]) < 1e-6 for k in want)


def test_capacity_drops_like_torch():
    cfg = family("qwen3")
    cfg.moe.capacity_factor = 0.5
    torch.manual_seed(3)
    from moetrain.models.transformer import MoETransformer as TorchModel

    tmodel = TorchModel(cfg)
    jmodel = MoETransformer(cfg, rngs=nnx.Rngs(0))
    convert.from_torch(tmodel, jmodel)
    ids, labels = batch(seed=3)
    with torch.no_grad():
        want = tmodel(ids, labels).loss
    got = jmodel(jnp.asarray(ids.numpy()), jnp.asarray(labels.numpy())).loss
    assert abs(float(got) - float(want)) <= RTOL * abs(float(want))


def test_weights_round_trip_and_mismatch_is_one_clear_error():
    tmodel, jmodel = _pair("gptoss")
    other = build("gptoss", seed=5)
    convert.to_torch(jmodel, other)
    for k, v in tmodel.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    with pytest.raises(ValueError, match="missing.*layers.0.attn.sinks"):
        convert.load_state_dict(jmodel, {k: v for k, v in tmodel.state_dict().items() if k != "layers.0.attn.sinks"})


def test_counts_accumulate_only_while_counting():
    _, jmodel = _pair("mixtral")
    ids, _ = batch(seed=4)
    jmodel(jnp.asarray(ids.numpy()))
    layer = jmodel.moe_layers()[0]
    T, K = ids.numel(), jmodel.cfg.moe.topk
    assert float(layer.tokens_per_expert[...].sum()) == T * K
    jmodel.set_counting(False)
    jmodel(jnp.asarray(ids.numpy()))
    assert float(layer.tokens_per_expert[...].sum()) == T * K
