"""Model definitions: every family end to end, attention vs naive softmax, RoPE/YaRN formulas,
causality, recompute equivalence, MTP, meta-device build."""

import math

import pytest
import torch
import torch.nn.functional as F

from moetrain import ops
from moetrain.config.schema import Config
from moetrain.models import build_model
from moetrain.models.attention import GQAAttention, MLAttention
from moetrain.models.linear import Embedding, Linear
from moetrain.models.mlp import MLP
from moetrain.models.rope import RopeParams, yarn_get_mscale, yarn_ramp_range
from moetrain.models.transformer import MoETransformer, mtp_tokens_and_targets

V, S = 128, 16
FAMILIES = ["deepseek", "qwen3", "mixtral", "gptoss", "llama", "dense_gelu"]


def family(name: str) -> Config:
    cfg = Config()
    m, e = cfg.model, cfg.moe
    m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads, m.ffn_hidden_size = V, 32, 2, 4, 64
    cfg.train.seq_length = S
    e.moe_ffn_hidden_size = 16
    if name == "deepseek":
        m.num_layers = 3
        m.attention_type, m.q_lora_rank, m.kv_lora_rank = "mla", 16, 16
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 8, 4, 6
        m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position = "yarn", 4.0, 8
        m.yarn_mscale, m.yarn_mscale_all_dim = 1.0, 1.0
        m.mtp_num_layers = 1
        e.num_experts, e.topk, e.score_function = 8, 2, "sigmoid"
        e.num_groups, e.topk_groups, e.group_score = 4, 2, "top2_sum"
        e.num_shared_experts, e.expert_bias, e.scaling_factor, e.first_k_dense = 1, True, 2.5, 1
        e.aux_loss_coeff, e.aux_loss_type = 1e-3, "sequence"
    elif name == "qwen3":
        m.head_dim, m.num_query_groups, m.qk_norm = 16, 2, True
        e.num_experts, e.topk, e.aux_loss_coeff, e.z_loss_coeff = 8, 2, 1e-2, 1e-3
    elif name == "mixtral":
        m.num_query_groups, m.sliding_window, m.sliding_window_every = 2, 4, 1
        e.num_experts, e.topk, e.aux_loss_coeff = 4, 2, 2e-2
    elif name == "gptoss":
        m.head_dim, m.num_query_groups = 8, 2
        m.attention_bias, m.attention_sinks, m.sliding_window, m.sliding_window_every = True, True, 4, 2
        m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position = "yarn", 8.0, 8
        e.num_experts, e.topk, e.activation = 4, 2, "swiglu_clamped"
        e.expert_linear_bias, e.router_bias, e.aux_loss_coeff = True, True, 1e-3
    elif name == "llama":
        m.num_query_groups, m.tie_embeddings = 2, True
    elif name == "dense_gelu":
        m.activation = "gelu"
    else:
        raise KeyError(name)
    cfg.check()
    return cfg


def batch(seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, -3:] = -100  # some ignored targets
    return ids[:, :-1], labels


def build(name, seed=0, **train):
    cfg = family(name)
    for key, value in train.items():
        setattr(cfg.train, key, value)
    torch.manual_seed(seed)
    return MoETransformer(cfg)


# ---- every family end to end ----------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_family_forward_backward(name):
    model = build(name)
    ids, labels = batch()
    out = model(ids, labels)
    assert out.lm_loss.item() == pytest.approx(math.log(V), abs=0.05)  # uniform prediction at init
    expected = out.lm_loss + out.aux_loss
    if model.cfg.model.mtp_num_layers:
        assert out.mtp_loss.item() == pytest.approx(math.log(V), abs=0.05)
        expected = expected + model.cfg.model.mtp_loss_scale * out.mtp_loss
    else:
        assert out.mtp_loss is None
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    if model.cfg.moe.aux_loss_coeff > 0:
        assert out.aux_loss.item() > 0
    out.loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all(), n
    # logits path equals the loss path
    logits = model(ids)
    assert logits.shape == (2, S, V) and logits.dtype == torch.float32
    ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    assert ce.item() == pytest.approx(out.lm_loss.item(), rel=1e-5)


def test_parameter_names_follow_contract():
    names = {n: tuple(p.shape) for n, p in build("deepseek").named_parameters()}
    # first_k_dense layer: dense swiglu, gate/up [F, H], down [H, F]
    assert names["layers.0.mlp.gate_proj.weight"] == names["layers.0.mlp.up_proj.weight"] == (64, 32)
    assert names["layers.0.mlp.down_proj.weight"] == (32, 64)
    assert names["layers.1.mlp.router.weight"] == (8, 32)
    assert names["layers.1.mlp.experts.w1"] == (8, 32, 32) and names["layers.1.mlp.experts.w2"] == (8, 32, 16)
    assert names["layers.1.mlp.shared.gate_proj.weight"] == names["layers.1.mlp.shared.up_proj.weight"] == (16, 32)
    assert names["layers.1.mlp.shared.down_proj.weight"] == (32, 16)
    assert names["layers.1.attn.q_a_proj.weight"] == (16, 32)
    assert names["layers.1.attn.q_b_proj.weight"] == (4 * 12, 16)
    assert names["layers.1.attn.kv_a_proj.weight"] == (16 + 4, 32)
    assert names["layers.1.attn.kv_b_proj.weight"] == (4 * (8 + 6), 16)
    assert names["layers.1.attn.o_proj.weight"] == (32, 4 * 6)
    assert names["mtp.0.eh_proj.weight"] == (32, 64)
    assert "mtp.0.block.mlp.experts.w1" in names and "head.weight" in names
    buffers = dict(build("deepseek").named_buffers())
    assert buffers["layers.1.mlp.router.expert_bias"].dtype == torch.float32
    g = {n: tuple(p.shape) for n, p in build("gptoss").named_parameters()}
    assert g["layers.0.attn.sinks"] == (4,) and g["layers.0.attn.o_proj.bias"] == (32,)
    assert g["layers.0.attn.k_proj.bias"] == (16,) and g["layers.0.mlp.experts.b1"] == (4, 32)
    assert g["layers.0.mlp.router.bias"] == (4,)
    assert "head.weight" not in dict(build("llama").named_parameters())


def test_linear_and_embedding_are_torch_modules_without_rng_in_constructors():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    lin, emb = Linear(8, 4, bias=True), Embedding(10, 8)
    assert torch.equal(torch.get_rng_state(), before)  # torch's own reset_parameters would have drawn
    assert isinstance(lin, torch.nn.Linear) and isinstance(emb, torch.nn.Embedding)
    assert lin.weight.shape == (4, 8) and lin.bias.shape == (4,) and Linear(8, 4).bias is None
    assert emb.weight.shape == (10, 8)
    modules = dict(build("deepseek").named_modules())
    assert isinstance(modules["embed"], torch.nn.Embedding) and isinstance(modules["head"], torch.nn.Linear)
    for name in ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj",
                 "layers.1.mlp.shared.gate_proj", "layers.1.attn.q_b_proj", "layers.1.attn.o_proj", "mtp.0.eh_proj"):
        assert isinstance(modules[name], torch.nn.Linear), name
    x = torch.randn(3, 8)
    randomize(lin, 0)
    randomize(emb, 1)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=1e-6, atol=1e-6)
    assert torch.equal(emb(torch.tensor([3, 0, 9])), emb.weight[[3, 0, 9]])


def test_init_values_and_meta_build():
    model = build("gptoss", seed=7)
    sd = model.state_dict()
    assert torch.equal(sd["layers.0.input_norm.weight"], torch.ones(32))
    assert torch.equal(sd["layers.0.attn.q_proj.bias"], torch.zeros(32))
    assert torch.equal(sd["layers.0.mlp.experts.b2"], torch.zeros(4, 32))
    assert sd["embed.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert sd["layers.0.mlp.experts.w1"].mean().abs().item() < 1e-3
    assert next(build_model(family("gptoss"), device="meta").parameters()).is_meta


@pytest.mark.parametrize("name", ["gptoss", "deepseek", "dense_gelu"])
def test_meta_build_then_init_equals_cpu_build(name):
    """Same seed, same weights: construction draws nothing, init_weights draws everything."""
    sd = build(name, seed=7).state_dict()
    with torch.device("meta"):
        meta = MoETransformer(family(name))
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    got = meta.state_dict()
    assert got.keys() == sd.keys()
    for key, value in got.items():
        assert torch.equal(value, sd[key]), key


# ---- causality --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_causality(name):
    model = build(name)
    ids, _ = batch()
    j = 9
    changed = ids.clone()
    changed[:, j] = (ids[:, j] + 1) % V
    with torch.no_grad():
        a, b = model(ids), model(changed)
    # (not bit-exact: expert GEMMs see a different mix of rows, so summation order changes)
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-6)
    assert (a[:, j] - b[:, j]).abs().max() > 1e-4


def test_sliding_window_limits_receptive_field():
    # mixtral: both layers use a window of 4, so position i sees at most i - 6 after two layers
    model = build("mixtral")
    ids, _ = batch()
    changed = ids.clone()
    changed[:, 2] = (ids[:, 2] + 1) % V
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, 9:], b[:, 9:], rtol=0, atol=1e-6)
    assert (a[:, 8] - b[:, 8]).abs().max() > 1e-5


# ---- recompute ---------------------------------------------------------------------------------

def saved_numel(model, ids, labels):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, labels)
    return out, total


@pytest.mark.parametrize("name", ["deepseek", "gptoss"])
def test_recompute_modes_match(name):
    ids, labels = batch(seed=3)
    results = {}
    last = 3 if name == "deepseek" else 1  # deepseek: its MTP block; gptoss: its second layer
    for mode, layer_ids in [("none", None), ("selective", None), ("full", None), ("selective", [0, last])]:
        model = build(name)
        model.set_recompute(mode, layer_ids)
        out, saved = saved_numel(model, ids, labels)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[(mode, str(layer_ids))] = (out.loss.detach(), grads, saved)
    ref_loss, ref_grads, ref_saved = results[("none", "None")]
    for key, (loss, grads, _) in results.items():
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-7, msg=f"{key} {n}")
    # less is kept for backward as recompute grows
    assert results[("full", "None")][2] < results[("selective", "None")][2] < ref_saved
    assert results[("selective", f"[0, {last}]")][2] < results[("selective", "None")][2]


@pytest.mark.parametrize("name", ["deepseek", "llama"])  # MTP with an untied head; a tied head
def test_fused_loss_gives_the_unfused_losses_and_gradients(name):
    """train.fused_loss: the LM and MTP losses through ops.linear_cross_entropy equal the logits path's, and so do
    every parameter's gradients (fp32, up to summation order), ignored labels included."""
    ids, labels = batch(seed=5)
    out = {}
    for fused in (False, True):
        model = build(name, fused_loss=fused)
        o = model(ids, labels)
        o.loss.backward()
        out[fused] = (o, {n: p.grad.clone() for n, p in model.named_parameters()})
    (ref, ref_grads), (got, grads) = out[False], out[True]
    for field in ("loss", "lm_loss", "mtp_loss"):
        if getattr(ref, field) is not None:
            torch.testing.assert_close(getattr(got, field), getattr(ref, field), rtol=1e-5, atol=1e-6, msg=field)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_set_recompute_layer_ids():
    model = build("deepseek")
    model.set_recompute("selective", [1, 3])
    assert [blk.recompute for _, blk in model.blocks()] == ["selective", "full", "selective", "full"]
    assert model.layers["0"].attn.recompute_core and not model.layers["1"].attn.recompute_core
    assert model.layers["2"].mlp.recompute_experts
    with pytest.raises(ValueError):
        model.set_recompute("full", [4])
    cfg = family("qwen3")
    cfg.train.recompute, cfg.train.recompute_layer_ids = "full", [1]
    assert [b.recompute for _, b in MoETransformer(cfg).blocks()] == ["full", "full"]


# ---- MTP ---------------------------------------------------------------------------------------

def test_mtp_shift():
    labels = torch.tensor([[1, 2, 3, 4, 5]])
    tok, tgt = mtp_tokens_and_targets(labels, 1)
    assert tok.tolist() == [[1, 2, 3, 4, 5]] and tgt.tolist() == [[2, 3, 4, 5, -100]]
    tok, tgt = mtp_tokens_and_targets(torch.tensor([[1, 2, -100, 4, 5]]), 2)
    assert tok.tolist() == [[2, 0, 4, 5, 0]] and tgt.tolist() == [[-100, 4, 5, -100, -100]]


def test_mtp_loss_matches_manual():
    model = build("deepseek")
    ids, labels = batch(seed=5)
    out = model(ids, labels)
    with torch.no_grad():
        cos, sin = model.rope.tables(S)
        h = model.embed(ids)
        for blk in model.layers.values():
            h = blk(h, cos, sin)
        d = model.mtp["0"]
        nxt = labels.clamp(min=0)  # position i holds t_{i+1}
        x = d.eh_proj(torch.cat([d.enorm(model.embed(nxt)), d.hnorm(h)], -1))
        hm = d.block(x, cos, sin)
        logits = d.final_norm(hm) @ model.head.weight.t()
        target = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
        ref = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=-100)
    assert out.mtp_loss.item() == pytest.approx(ref.item(), rel=1e-6)


# ---- dense MLP --------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
def test_mlp_equals_one_concatenated_gate_up_weight(activation):
    """Separate gate/up weights compute what one [2F, H] weight [gate; up] did (forward and all
    gradients, fp32): down(ops.swiglu(F.linear(x, cat[gate, up])))."""
    H, F_ = 24, 20
    mlp = MLP(H, F_, activation)
    randomize(mlp, 5)
    x = (3 * torch.randn(2, 7, H, generator=torch.Generator().manual_seed(6))).requires_grad_()
    y = mlp(x)
    w1 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().requires_grad_()
    w2 = mlp.down_proj.weight.detach().requires_grad_()
    x_ref = x.detach().requires_grad_()
    h = F.linear(x_ref, w1)
    if activation == "swiglu_clamped":  # both clamps active somewhere
        assert (h[..., :F_] > 7).any() and (h[..., F_:].abs() > 7).any()
    ref = F.linear(ops.swiglu(h, activation), w2)
    torch.testing.assert_close(y, ref)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    y.backward(dy)
    ref.backward(dy)
    torch.testing.assert_close(torch.cat([mlp.gate_proj.weight.grad, mlp.up_proj.weight.grad]), w1.grad)
    torch.testing.assert_close(mlp.down_proj.weight.grad, w2.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_gelu_mlp_has_no_gate():
    mlp = MLP(12, 10, "gelu").double()
    randomize(mlp, 8)
    assert mlp.gate_proj is None and [n for n, _ in mlp.named_parameters()] == ["up_proj.weight", "down_proj.weight"]
    x = torch.randn(3, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    h = x @ mlp.up_proj.weight.T
    ref = (0.5 * h * (1 + torch.erf(h / math.sqrt(2)))) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), ref, rtol=1e-12, atol=1e-12)


# ---- attention vs naive softmax ----------------------------------------------------------------

def rotate(x, pos, inv_freq, scale):
    """x [D] at position pos: complex rotation of the pairs (i, i + D/2)."""
    half = x.shape[0] // 2
    z = torch.complex(x[:half], x[half:]) * torch.polar(torch.ones(half, dtype=x.dtype), pos * inv_freq) * scale
    return torch.cat([z.real, z.imag])


def fp64_tables(rope, S_):
    """cos/sin like RopeParams.tables but in fp64, so the comparison is not limited by fp32 tables."""
    freqs = torch.outer(torch.arange(S_, dtype=torch.float64), rope.inv_freq().double())
    return freqs.cos() * rope.cos_sin_scale, freqs.sin() * rope.cos_sin_scale


def naive_softmax_attention(q, k, v, scale, window=None, sinks=None):
    """q [S, nh, d], k [S, nkv, d], v [S, nkv, dv] -> [S, nh, dv], one row at a time."""
    S_, nh = q.shape[:2]
    group = nh // k.shape[1]
    out = torch.zeros(S_, nh, v.shape[-1], dtype=q.dtype)
    for h in range(nh):
        for i in range(S_):
            js = [j for j in range(i + 1) if window is None or i - j < window]
            logits = [float((q[i, h] @ k[j, h // group]).detach()) * scale for j in js]
            extra = [float(sinks[h].detach())] if sinks is not None else []
            mx = max(logits + extra)
            z = sum(math.exp(s - mx) for s in logits + extra)
            for j, s in zip(js, logits):
                out[i, h] += math.exp(s - mx) / z * v[j, h // group]
    return out


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.4)


@pytest.mark.parametrize("window,sinks,qk_norm,bias", [
    (None, False, False, False),  # SDPA is_causal + GQA
    (3, False, True, False),      # SDPA with a window mask
    (3, True, False, True),       # manual softmax with sinks and window
    (None, True, True, True),     # manual softmax with sinks
])
def test_gqa_matches_naive(window, sinks, qk_norm, bias):
    cfg = Config()
    m = cfg.model
    m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim = 12, 4, 2, 6
    m.qk_norm, m.attention_sinks, m.attention_bias = qk_norm, sinks, bias
    m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position = "yarn", 4.0, 4
    attn = GQAAttention(cfg, window).double()
    randomize(attn, 1)
    B, S_ = 2, 7
    x = torch.randn(B, S_, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cos, sin = fp64_tables(attn.rope, S_)
    y = attn(x, cos, sin)
    inv = attn.rope.inv_freq().double()
    cs = attn.rope.cos_sin_scale
    assert cs == pytest.approx(0.1 * math.log(4) + 1)
    for b in range(B):
        q = attn.q_proj(x[b]).view(S_, 4, 6)
        k = attn.k_proj(x[b]).view(S_, 2, 6)
        v = attn.v_proj(x[b]).view(S_, 2, 6)
        if qk_norm:
            q, k = rms(q, attn.q_norm.weight, m.norm_eps), rms(k, attn.k_norm.weight, m.norm_eps)
        q = torch.stack([torch.stack([rotate(q[s, h], s, inv, cs) for h in range(4)]) for s in range(S_)])
        k = torch.stack([torch.stack([rotate(k[s, h], s, inv, cs) for h in range(2)]) for s in range(S_)])
        o = naive_softmax_attention(q, k, v, 6 ** -0.5, window, attn.sinks if sinks else None)
        torch.testing.assert_close(y[b], attn.o_proj(o.reshape(S_, 24)), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("nh,nkv,S,d,window,blocks", [
    (4, 2, 7, 6, None, 1), (4, 2, 7, 6, 3, 1), (8, 8, 33, 64, None, 1), (4, 1, 20, 16, 5, 1),
    (4, 2, 300, 8, 7, 3),      # banded: 3 blocks of 128 queries, the last one padded
    (2, 1, 1000, 8, 128, 8),   # GPT-OSS's window
])
def test_sink_attention_equals_the_explicit_softmax_with_gradients(nh, nkv, S, d, window, blocks):
    """The sink written as a key (padded head dim, keys padded to 16; with a short window, query blocks against their
    bands of keys) against the [S, S + 1] softmax, in fp64."""
    from moetrain.models.accounting import sink_attention_blocks
    from moetrain.models.attention import sink_attention, sink_attention_reference

    assert sink_attention_blocks(d, S, window).blocks == blocks

    g = torch.Generator().manual_seed(S)
    shapes = [(2, nh, S, d), (2, nkv, S, d), (2, nkv, S, d), (nh,)]
    leaves = [torch.randn(s, dtype=torch.float64, generator=g, requires_grad=True) for s in shapes]
    got = sink_attention(*leaves[:3], scale=d**-0.5, window=window, sinks=leaves[3])
    want = sink_attention_reference(*leaves[:3], scale=d**-0.5, window=window, sinks=leaves[3])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    probe = torch.randn(got.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(got, leaves, probe), torch.autograd.grad(want, leaves, probe)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("q_lora", [None, 10])
def test_mla_matches_naive(q_lora):
    cfg = Config()
    m = cfg.model
    m.attention_type, m.hidden_size, m.num_attention_heads = "mla", 12, 3
    m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = q_lora, 8, 4, 4, 5
    m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position = "yarn", 40.0, 4
    m.yarn_mscale, m.yarn_mscale_all_dim = 1.0, 1.0
    attn = MLAttention(cfg).double()
    randomize(attn, 3)
    S_ = 6
    x = torch.randn(1, S_, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cos, sin = fp64_tables(attn.rope, S_)
    y = attn(x, cos, sin)[0]
    mscale = 0.1 * math.log(40.0) + 1
    assert attn.scale == pytest.approx(8 ** -0.5 * mscale ** 2)
    inv = attn.rope.inv_freq().double()
    xs = x[0]
    if q_lora:
        qa = attn.q_a_proj(xs)
        q = attn.q_b_proj(rms(qa, attn.q_a_norm.weight, m.norm_eps))
    else:
        q = attn.q_proj(xs)
    q = q.view(S_, 3, 8)
    ckv = attn.kv_a_proj(xs)
    c, kr = ckv[:, :8], ckv[:, 8:]
    kv = attn.kv_b_proj(rms(c, attn.kv_a_norm.weight, m.norm_eps)).view(S_, 3, 9)
    qs, ks = [], []
    for s in range(S_):
        kr_s = rotate(kr[s], s, inv, 1.0)  # DeepSeek mscale = mscale_all_dim: cos/sin unscaled
        qs.append(torch.stack([torch.cat([q[s, h, :4], rotate(q[s, h, 4:], s, inv, 1.0)]) for h in range(3)]))
        ks.append(torch.stack([torch.cat([kv[s, h, :4], kr_s]) for h in range(3)]))
    o = naive_softmax_attention(torch.stack(qs), torch.stack(ks), kv[:, :, 4:], 8 ** -0.5 * mscale ** 2)
    torch.testing.assert_close(y, attn.o_proj(o.reshape(S_, 15)), rtol=1e-9, atol=1e-11)


# ---- RoPE / YaRN -------------------------------------------------------------------------------

def test_yarn_ramp_bounds_deepseek_v3_and_gpt_oss():
    # DeepSeek-V3: rope dim 64, theta 1e4, 4096 original positions, betas 32/1, rounded
    low = 64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(1e4))  # 10.47
    high = 64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(1e4))  # 22.51
    assert yarn_ramp_range(64, 1e4, 4096, 32, 1, truncate=True) == (math.floor(low), math.ceil(high)) == (10, 23)
    # GPT-OSS: theta 150000, not rounded
    lo, hi = yarn_ramp_range(64, 150000.0, 4096, 32, 1, truncate=False)
    assert lo == pytest.approx(8.0928, abs=1e-3) and hi == pytest.approx(17.398, abs=1e-3)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_inv_freq_formula(truncate):
    dim, theta, factor, L = 32, 10000.0, 8.0, 256
    p = RopeParams(dim=dim, theta=theta, yarn=True, factor=factor, original_max_position=L, truncate=truncate)
    corr = [dim * math.log(L / (r * 2 * math.pi)) / (2 * math.log(theta)) for r in (32.0, 1.0)]
    lo, hi = (math.floor(corr[0]), math.ceil(corr[1])) if truncate else tuple(corr)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    want = []
    for i in range(dim // 2):
        base = theta ** (-2 * i / dim)
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep (high freq), 1: divide by factor
        want.append(base / factor * ramp + base * (1 - ramp))
    got = p.inv_freq()
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    assert got[0].item() == pytest.approx(1.0) and got[-1].item() == pytest.approx(theta ** (-30 / 32) / factor, rel=1e-6)
    plain = RopeParams(dim=dim, theta=theta).inv_freq()
    assert plain.tolist() == pytest.approx([theta ** (-2 * i / dim) for i in range(16)], rel=1e-6)


def test_yarn_mscale():
    assert yarn_get_mscale(1.0, 1.0) == 1.0 and yarn_get_mscale(40.0, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40) + 1)
    ds = RopeParams(dim=64, yarn=True, factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    assert ds.cos_sin_scale == pytest.approx(1.0)
    assert ds.softmax_scale_multiplier == pytest.approx((0.1 * math.log(40.0) + 1) ** 2)
    oss = RopeParams(dim=64, theta=150000.0, yarn=True, factor=32.0, truncate=False)
    assert oss.cos_sin_scale == pytest.approx(0.1 * math.log(32.0) + 1)
    assert oss.softmax_scale_multiplier == 1.0
    cos, sin = oss.tables(5)
    inv = oss.inv_freq()
    assert cos[3, 7].item() == pytest.approx(math.cos(3 * inv[7].item()) * oss.cos_sin_scale, rel=1e-5)
    assert sin[4, 2].item() == pytest.approx(math.sin(4 * inv[2].item()) * oss.cos_sin_scale, rel=1e-5)
    assert RopeParams(dim=8).cos_sin_scale == 1.0 and RopeParams(dim=8).softmax_scale_multiplier == 1.0
    # the config decides: GPT-OSS-like (sinks) does not round the ramp bounds, others do
    assert RopeParams.from_model_config(family("gptoss").model, 8).truncate is False
    assert RopeParams.from_model_config(family("deepseek").model, 4).truncate is True
