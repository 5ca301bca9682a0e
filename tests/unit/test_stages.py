"""A model split into pipeline stages by a layout string, run stage after stage, gives the whole model's loss and
gradients (parameter names preserved; a weight copied into two stages gets the sum of their gradients)."""

import pytest
import torch

from moetrain.config.schema import Config
from moetrain.models.stages import split_stages, stage_contents
from moetrain.models.transformer import MoETransformer

V, S = 64, 6


def model_of(tie: bool, mtp: int) -> MoETransformer:
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.hidden_size, m.num_layers, m.vocab_size, m.mtp_num_layers, m.tie_embeddings = 16, 4, V, mtp, tie
    m.num_heads, m.num_kv_heads, m.ffn_hidden_size = 2, 1, 24
    e.num_experts, e.topk, e.moe_ffn_hidden_size, e.first_k_dense = 4, 2, 8, 1
    e.aux_loss_coeff, e.z_loss_coeff = 0.01, 0.001
    cfg.train.recompute_layer_ids = [2]  # one block under full recompute
    torch.manual_seed(0)
    return MoETransformer(cfg).double()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, S), generator=g), torch.randint(0, V, (2, S), generator=g)


def whole(model, ids, labels):
    out = model(ids, labels)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def staged(stages, ids, labels):
    x = ids
    for st in stages[:-1]:
        x = st(x)
    out = stages[-1](x, labels)
    out.loss.backward()
    grads = {}
    for st in stages:
        for n, p in st.named_parameters():
            grads[n] = grads[n] + p.grad if n in grads else p.grad.clone()
    aux = sum(st.aux_value() for st in stages)
    return out, grads, aux


@pytest.mark.parametrize("layout,tie,mtp", [
    ("Et*2|t*2L", False, 0),
    ("Et|t*2|tL", True, 0),
    ("Et*2|t|tmL", False, 1),
    ("E|t*4|mL", True, 1),
])
def test_stages_run_in_order_give_the_whole_models_loss_and_gradients(layout, tie, mtp):
    model = model_of(tie, mtp)
    ids, labels = batch()
    stages = split_stages(model, layout)
    want, want_grads = whole(model, ids, labels)
    got, got_grads, aux = staged(stages, ids, labels)
    torch.testing.assert_close(got.lm_loss, want.lm_loss, rtol=1e-12, atol=0)
    if mtp:
        torch.testing.assert_close(got.mtp_loss, want.mtp_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(aux.float(), want.aux_loss, rtol=1e-6, atol=0)  # the logged value is fp32
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-10, atol=1e-13, msg=name)


def test_stage_modules_hold_only_their_parts_under_the_models_names():
    model = model_of(tie=False, mtp=1)
    first, middle, last = split_stages(model, "Et|t*2|tmL")
    assert list(first.layers) == ["0"] and first.embed is not None and first.final_norm is None
    assert list(middle.layers) == ["1", "2"] and middle.embed is None and not middle.embeds_input
    assert list(last.layers) == ["3"] and list(last.mtp) == ["0"] and last.embed is not None  # MTP embeds tokens
    names = set(model.state_dict())
    for st in (first, middle, last):
        assert set(st.state_dict()) <= names
    assert [gid for gid, _ in last.blocks()] == [3, 4]
    assert middle(torch.randn(2, S, 16, dtype=torch.float64)).shape == (2, S, 16)


def test_layouts_a_stage_split_cannot_run_are_refused():
    from moetrain.errors import ConfigError

    with pytest.raises(ValueError, match="MTP depths .m. must be on the stage with the loss"):
        stage_contents("Et*4m|L", 4, 1)
    with pytest.raises(ConfigError, match="places 3 decoder layers"):
        stage_contents("Et*2|tL", 4, 0)
