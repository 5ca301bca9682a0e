"""Hugging Face interop: tiny random transformers models (no downloads) -> moetrain -> same logits;
export gives back the very same tensors; sharding, fused/MXFP4 expert forms, MTP, clear errors.

Every parameter of the HF models is randomised (norm weights around 1, biases, sinks and the
DeepSeek expert bias included) so that a swapped or mis-permuted tensor changes the logits.
"""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from moetrain.errors import UserError  # noqa: E402
from moetrain.models.hf import config_from_hf, export_hf, from_hf, load_hf_weights  # noqa: E402
from moetrain.models.mxfp4 import dequantize_mxfp4  # noqa: E402

V = 96
COMMON = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES = {
    # MLA with q LoRA, YaRN with mscale/mscale_all_dim, sigmoid group-limited routing (top2_sum),
    # expert bias, shared expert, a dense first layer, routed scaling.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        COMMON, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        num_key_value_heads=4, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=1024,
        rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=256,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8))),
    # MLA without q LoRA, softmax group-limited routing (max), 2 shared experts.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        COMMON, num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=2,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, num_key_value_heads=4, routed_scaling_factor=1.5)),
    # qk-norm, GQA, explicit head_dim != hidden/heads, a dense first layer, sliding window.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        COMMON, num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2, num_key_value_heads=2, head_dim=16, norm_topk_prob=True, mlp_only_layers=[0],
        use_sliding_window=True, sliding_window=5)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        COMMON, num_hidden_layers=2, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        num_key_value_heads=2, sliding_window=6)),
    # sinks, q/k/v/o biases, router bias, expert biases, clamped SwiGLU, alternating sliding window
    # (4 tokens) and full attention, YaRN without truncation.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        COMMON, hidden_size=64, num_hidden_layers=3, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, num_key_value_heads=2, head_dim=16, sliding_window=4, rms_norm_eps=1e-5)),
}


def perturbed_tiny(*overrides, seed=0):
    """The tiny preset with every weight and the expert bias moved off their initial values (so that a
    mapping that confuses two tensors shows in the logits)."""
    from moetrain.config.load import load_config
    from moetrain.models import build_model

    cfg = load_config(preset="tiny", overrides=list(overrides))
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for layer in model.moe_layers():
            layer.router.expert_bias.normal_(0.0, 0.05)
    return model


def make_hf(family, seed=0, **over):
    """A tiny transformers model of ``family`` with every parameter and buffer randomised."""
    cfg_name, model_name, kw = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**{**kw, **over})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def save(model, path, **kw):
    model.save_pretrained(path, **kw)
    return path


def tokens(seed=1, batch=2, seq=12):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel_err(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def all_tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (HF model, its save_pretrained directory)."""
    root = tmp_path_factory.mktemp("hf")
    return {f: (m := make_hf(f), save(m, root / f)) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_and_export_is_bit_exact(family, saved, tmp_path):
    hf_model, path = saved[family]
    ids = tokens()
    with torch.no_grad():
        ref = hf_model(ids).logits
        model = from_hf(path)
        logits = model(ids)
    assert logits.shape == (2, 12, V) and logits.dtype == torch.float32
    assert rel_err(logits, ref) < 1e-4
    # export with the original config.json as base: the same tensors, bit for bit
    base = json.loads((path / "config.json").read_text())
    out = export_hf(model, model.cfg, tmp_path / "out", base_config=base)
    assert_same_tensors(all_tensors(path), all_tensors(out))
    # and transformers reads the export as the same model
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert rel_err(again, ref) < 1e-4


def test_config_mapping_of_each_family(saved):
    v3 = config_from_hf(saved["deepseek_v3"][1])
    assert (v3.model.attention_type, v3.model.q_lora_rank, v3.model.rope_scaling, v3.model.yarn_mscale_all_dim) == \
        ("mla", 16, "yarn", 0.8)
    assert (v3.moe.num_groups, v3.moe.topk_groups, v3.moe.group_score, v3.moe.score_function) == \
        (4, 2, "top2_sum", "sigmoid")
    assert (v3.moe.expert_bias, v3.moe.first_k_dense, v3.moe.scaling_factor, v3.model.mtp_num_layers) == \
        (True, 1, 2.5, 0)  # num_nextn_predict_layers = 1 but no MTP weights saved by transformers
    v2 = config_from_hf(saved["deepseek_v2"][1])
    assert (v2.model.q_lora_rank, v2.moe.group_score, v2.moe.score_function, v2.shared_ffn_size) \
        == (None, "max", "softmax", 32)
    q = config_from_hf(saved["qwen3_moe"][1])
    assert (q.model.qk_norm, q.model.head_dim, q.moe.first_k_dense, q.model.sliding_window,
            q.model.sliding_window_every) == (True, 16, 1, 5, 1)
    g = config_from_hf(saved["gpt_oss"][1])
    assert (g.model.attention_sinks, g.model.sliding_window, g.model.sliding_window_every, g.moe.activation,
            g.model.yarn_truncate, g.moe.router_bias, g.moe.expert_linear_bias) == \
        (True, 4, 2, "swiglu_clamped", False, True, True)
    assert g.model.from_hf == str(saved["gpt_oss"][1]) and g.model.name == "gpt_oss"


def test_sharded_checkpoints_load_and_export_sharded(saved, tmp_path):
    hf_model, _ = saved["qwen3_moe"]
    path = save(hf_model, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    ids = tokens(2)
    with torch.no_grad():
        ref = hf_model(ids).logits
        model = from_hf(path)
        assert rel_err(model(ids), ref) < 1e-4
        out = export_hf(model, model.cfg, tmp_path / "out", max_shard_size="30KB")
        written = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(written["weight_map"].values())) > 3
        assert not (out / "model.safetensors").exists()
        for name, file in written["weight_map"].items():  # the index tells the truth
            with safe_open(str(out / file), "pt") as f:
                assert name in f.keys()
        assert_same_tensors(all_tensors(path), all_tensors(out))
        assert rel_err(from_hf(out)(ids), ref) < 1e-4


def test_transformers_fused_expert_form_loads(saved, tmp_path):
    for family in ("mixtral", "deepseek_v3"):
        hf_model, _ = saved[family]
        path = save(hf_model, tmp_path / family, save_original_format=False)
        names = set(load_file(path / "model.safetensors"))
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
        ids = tokens(3)
        with torch.no_grad():
            assert rel_err(from_hf(path)(ids), hf_model(ids).logits) < 1e-4


def test_bf16_load_and_dtype(saved):
    hf_model, path = saved["mixtral"]
    model = from_hf(path, dtype=torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    assert torch.equal(model.layers["1"].mlp.experts.w2[3], hf_model.model.layers[1].mlp.experts.down_proj[3].bfloat16())


# ---- DeepSeek-V3 MTP ----------------------------------------------------------------------------

def add_mtp_layer(path, hf_model):
    """Append an MTP depth as the released V3 checkpoints store it (layer num_hidden_layers):
    its decoder block copies the last layer (an MoE layer), plus enorm/hnorm/eh_proj/shared_head
    and copies of the embedding and head."""
    L = hf_model.config.num_hidden_layers
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    mtp = {f"model.layers.{L}." + k[len(f"model.layers.{L - 1}."):]: v.clone()
           for k, v in tensors.items() if k.startswith(f"model.layers.{L - 1}.")}
    H = hf_model.config.hidden_size
    for name, shape in (("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("eh_proj.weight", (H, 2 * H)),
                        ("shared_head.norm.weight", (H,))):
        mtp[f"model.layers.{L}.{name}"] = torch.randn(shape, generator=g)
    mtp[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return mtp


def test_deepseek_v3_mtp_weights_kept_or_dropped(saved, tmp_path):
    hf_model, src = saved["deepseek_v3"]
    path = tmp_path / "v3mtp"
    shutil.copytree(src, path)
    mtp = add_mtp_layer(path, hf_model)
    ids = tokens(4)
    with torch.no_grad():
        ref = hf_model(ids).logits
        model = from_hf(path)
        assert model.cfg.model.mtp_num_layers == 1
        assert rel_err(model(ids), ref) < 1e-4  # MTP does not change the main logits
        depth = model.mtp["0"]
        assert torch.equal(depth.eh_proj.weight, mtp["model.layers.3.eh_proj.weight"])
        assert torch.equal(depth.final_norm.weight, mtp["model.layers.3.shared_head.norm.weight"])
        # the MTP block was stored as a copy of layer 2: it must load exactly like layer 2
        block, last = depth.block.state_dict(), model.layers["2"].state_dict()
        assert sorted(block) == sorted(last) and all(torch.equal(block[k], last[k]) for k in block)
        out = model(ids, torch.roll(ids, -1, 1))
        assert out.mtp_loss is not None and torch.isfinite(out.mtp_loss)
        # export writes the MTP layer back, embedding/head copies included, bit for bit
        base = json.loads((path / "config.json").read_text())
        exported = export_hf(model, model.cfg, tmp_path / "out", base_config=base)
        assert_same_tensors(all_tensors(path), all_tensors(exported))
        # dropped: loads without the MTP module, exports without layer 3
        dropped = from_hf(path, mtp=False)
        assert dropped.cfg.model.mtp_num_layers == 0 and len(dropped.mtp) == 0
        assert rel_err(dropped(ids), ref) < 1e-4
        out2 = export_hf(dropped, dropped.cfg, tmp_path / "out2", base_config=base)
        assert json.loads((out2 / "config.json").read_text())["num_nextn_predict_layers"] == 0
        assert_same_tensors({k: v for k, v in all_tensors(path).items() if ".layers.3." not in k}, all_tensors(out2))
    with pytest.raises(UserError, match="MTP weights requested"):
        from_hf(src, mtp=True)


# ---- MXFP4 ---------------------------------------------------------------------------------------

def test_mxfp4_dequantization_hand_example():
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, :3] = torch.tensor([0x21, 0xF0, 0x8A], dtype=torch.uint8)
    blocks[1, 0, 0] = 0x7C  # low C = -2.0, high 7 = 6.0
    scales = torch.tensor([[128], [125]], dtype=torch.uint8)  # x 2, x 1/4
    out = dequantize_mxfp4(blocks, scales, dtype=torch.float32)
    assert out.shape == (2, 32)
    # byte 0x21: low 1 -> 0.5, high 2 -> 1.0; 0xF0: low 0 -> 0, high F -> -6; 0x8A: low A -> -1, high 8 -> -0
    assert out[0, :6].tolist() == [1.0, 2.0, 0.0, -12.0, -2.0, -0.0]
    assert torch.signbit(out[0, 5]) and out[0, 6:].eq(0).all()
    assert out[1, :2].tolist() == [-0.5, 1.5] and out[1, 2:].eq(0).all()


def e2m1_reference(code):
    """E2M1 by its definition: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def random_mxfp4(shape_out_in, gen):
    """(blocks, scales, dense [.., out, in]) with the dense values computed independently."""
    *lead, out, inp = shape_out_in
    blocks = torch.randint(0, 256, (*lead, out, inp // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 124, (*lead, out, inp // 32), generator=gen, dtype=torch.uint8)
    lut = torch.tensor([e2m1_reference(c) for c in range(16)])
    lo, hi = lut[(blocks & 15).long()], lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32]
    dense = vals * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return blocks, scales, dense.flatten(-2)


def test_gpt_oss_mxfp4_checkpoint_is_dequantized_on_import(tmp_path):
    hf_model = make_hf("gpt_oss", seed=3)
    E, I, H = 4, 32, 64
    gen = torch.Generator().manual_seed(7)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf_model.model.layers):
            gu_b, gu_s, gu = random_mxfp4((E, 2 * I, H), gen)  # [E, 2I (interleaved), H]
            dn_b, dn_s, dn = random_mxfp4((E, H, I), gen)
            layer.mlp.experts.gate_up_proj.copy_(gu.transpose(1, 2))  # HF param layout [E, H, 2I]
            layer.mlp.experts.down_proj.copy_(dn.transpose(1, 2))  # [E, I, H]
            q = f"model.layers.{i}.mlp.experts."
            packed.update({q + "gate_up_proj_blocks": gu_b, q + "gate_up_proj_scales": gu_s,
                           q + "down_proj_blocks": dn_b, q + "down_proj_scales": dn_s})
    path = save(hf_model, tmp_path / "mx")
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    (path / "config.json").write_text(json.dumps(config))
    ids = tokens(5)
    with torch.no_grad():
        assert rel_err(from_hf(path)(ids), hf_model(ids).logits) < 1e-4


# ---- errors ----------------------------------------------------------------------------------------

@pytest.fixture
def mixtral_copy(saved, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(saved["mixtral"][1], path)
    return path


def rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(mixtral_copy):
    rewrite(mixtral_copy, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(UserError, match=r"missing tensor\(s\) model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        from_hf(mixtral_copy)


def test_unexpected_tensor_is_named(mixtral_copy):
    rewrite(mixtral_copy, lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2)))
    with pytest.raises(UserError, match=r"unexpected tensor\(s\) model\.layers\.0\.self_attn\.extra\.weight"):
        from_hf(mixtral_copy)


def test_misshaped_tensor_is_named(mixtral_copy):
    rewrite(mixtral_copy, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(8, 32)))
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[8, 32\], "
                                        r"expected \[16, 32\]"):
        from_hf(mixtral_copy)


def test_unsupported_architecture_is_named(mixtral_copy):
    config = json.loads((mixtral_copy / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (mixtral_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"unsupported architecture LlamaForCausalLM \(model_type 'llama'\); "
                                        r"supported: DeepseekV2ForCausalLM \(deepseek_v2\), .*GptOssForCausalLM"):
        config_from_hf(mixtral_copy)


def test_missing_shard_and_mismatched_model_are_named(saved, tmp_path):
    hf_model, _ = saved["mixtral"]
    path = save(hf_model, tmp_path / "sh", max_shard_size="40KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(UserError, match=f"lists shard {victim.name}, which is missing"):
        from_hf(path)
    other = from_hf(saved["qwen3_moe"][1])
    with pytest.raises(UserError, match=r"does not match .*model\.hidden_size"):
        load_hf_weights(other, saved["gpt_oss"][1])


# ---- block-scaled FP8 (released DeepSeek-V3) ---------------------------------------------------------

def test_fp8_block_dequantization_hand_example():
    from moetrain.models.hf_io import dequantize_fp8_blocks

    w = torch.tensor([[1.0, 2.0, -0.5], [1.5, -4.0, 0.25], [3.0, 0.5, -1.0]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[2.0, 10.0], [0.5, -1.0]])  # blocks of 2 x 2: rows {0,1},{2} x cols {0,1},{2}
    out = dequantize_fp8_blocks(w, scale_inv, (2, 2))
    assert out.tolist() == [[2.0, 4.0, -5.0], [3.0, -8.0, 2.5], [1.5, 0.25, 1.0]]


def test_deepseek_v3_fp8_checkpoint_is_dequantized_on_import(saved, tmp_path):
    """Every 2-D projection stored as float8 + weight_scale_inv (128x128 blocks in the real
    checkpoints, 8x8 here): the model gets exactly the dequantized values."""
    _, src = saved["deepseek_v3"]
    tensors = load_file(src / "model.safetensors")
    fp8, plain = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and ("self_attn" in name or ".mlp." in name) and name.endswith(".weight"):
            R, C = t.shape
            scale = torch.rand(-(-R // 8), -(-C // 8), generator=torch.Generator().manual_seed(len(name))) + 0.5
            q = (t / scale.repeat_interleave(8, 0)[:R].repeat_interleave(8, 1)[:, :C]).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            deq = torch.empty(R, C)
            for i in range(R):  # the definition, one element at a time
                for j in range(C):
                    deq[i, j] = q[i, j].float() * scale[i // 8, j // 8]
            plain[name] = deq
        else:
            fp8[name] = plain[name] = t
    for name, data in (("fp8", fp8), ("plain", plain)):
        (tmp_path / name).mkdir()
        save_file(data, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((src / "config.json").read_text())
        if name == "fp8":
            config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8]}
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    a, b = from_hf(tmp_path / "fp8").state_dict(), from_hf(tmp_path / "plain").state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- export of a model trained from scratch ----------------------------------------------------------

def test_export_without_a_hf_origin_infers_the_family(tmp_path):
    """The tiny preset (DeepSeek-V3-shaped: MLA, group routing, expert bias, MTP) written as
    deepseek_v3; transformers reads it as the same model (it ignores the MTP layer)."""
    model = perturbed_tiny()
    cfg = model.cfg
    out = export_hf(model, cfg, tmp_path / "out", max_shard_size="1MB")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_nextn_predict_layers"], config["n_group"]) == ("deepseek_v3", 1, 4)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids)
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        assert rel_err(hf_logits, ref) < 1e-4
        back = from_hf(out)
        assert back.cfg.model.mtp_num_layers == 1
        mine, theirs = model.state_dict(), back.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # a family that cannot express the config is refused, naming the keys
    with pytest.raises(UserError, match=r"cannot be written in the Hugging Face mixtral format: .*model\.attention_type"):
        export_hf(model, cfg, tmp_path / "bad", model_type="mixtral", drop_mtp=True)
    with pytest.raises(UserError, match=r"model\.mtp_num_layers = 1: the qwen3_moe format has no MTP weights"):
        export_hf(model, cfg, tmp_path / "bad", model_type="qwen3_moe")


# ---- released configs -> the presets ----------------------------------------------------------------

RELEASED = {  # the architecture fields of the released config.json files (legacy rope format)
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8,
        moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000, tie_word_embeddings=False,
        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096, type="yarn"),
        quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128])),
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, topk_method="greedy",
        n_group=1, topk_group=1, norm_topk_prob=False, scoring_func="softmax", routed_scaling_factor=1.0,
        first_k_dense_replace=1, moe_layer_freq=1, aux_loss_alpha=0.001, seq_aux=True, rope_theta=10000,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=163840,
        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                          original_max_position_embeddings=4096, type="yarn")),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        sliding_window=None, use_sliding_window=False, max_window_layers=48, attention_bias=False,
        tie_word_embeddings=False, router_aux_loss_coef=0.001, hidden_act="silu"),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
        tie_word_embeddings=False, hidden_act="silu", router_aux_loss_coef=0.02),
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, rms_norm_eps=1e-5,
        rope_theta=150000, swiglu_limit=7.0, tie_word_embeddings=False, hidden_act="silu",
        rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0, original_max_position_embeddings=4096,
                          rope_type="yarn", truncate=False),
        quantization_config=dict(quant_method="mxfp4")),
}


@pytest.mark.parametrize("preset", list(RELEASED))
def test_released_configs_map_to_the_presets(preset):
    from moetrain.config.load import load_config
    from moetrain.models.hf_config import arch_from_hf, cfg_arch, effective_arch

    got = effective_arch(arch_from_hf(RELEASED[preset]))
    want = effective_arch(cfg_arch(load_config(preset=preset)))
    assert {k: (want[k], got[k]) for k in want if want[k] != got[k]} == {}
