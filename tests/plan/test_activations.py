"""The activation formula equals the bytes our modules really keep for backward.

On CPU, a decoder block runs forward under torch.autograd.graph.saved_tensors_hooks; every
saved tensor's storage is recorded once (parameters and the shared RoPE tables excluded), plus
the inputs that activation checkpointing keeps (recorded by wrapping the models' ``checkpoint``).
The sum must equal ``activations.block_terms`` exactly, for several module kinds, recompute
modes and both dtypes.
"""

import dataclasses

import pytest
import torch

from moetrain.bench.saved_bytes import StorageTracker, block_saved_bytes, seeded_block
from moetrain.config.load import load_config
from moetrain.models.transformer import MoETransformer
from moetrain.plan import activations as A

DT = {4: torch.float32, 2: torch.bfloat16}


def saved_bytes(cfg, moe, window, mode, dtype, B=2):
    x = torch.randn(B, cfg.train.seq_length, cfg.model.hidden_size, dtype=dtype, requires_grad=True)
    return block_saved_bytes(cfg, seeded_block(cfg, moe, window, mode, dtype), x)


def formula(cfg, moe, window, mode, b, B=2, S=16):
    d = A.Dims(B=B, S=S, b=b, device="cpu")
    return A.total(A.block_terms(cfg, d, moe, window, mode))


def tiny(**over):
    base = ["model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=48",
            "moe.moe_ffn_hidden_size=24", "train.micro_batch_size=2", "train.seq_length=16"]
    return load_config(preset="tiny", overrides=base + [f"{k}={v}" for k, v in over.items()])


GQA = {"model.attention_type": "gqa", "model.num_query_groups": 2, "model.mtp_num_layers": 0}
CASES = {
    # name: (overrides, moe block?, window)
    "mla-moe-shared-groups": ({}, True, None),
    "mla-dense": ({}, False, None),
    "mla-no-q-lora": ({"model.q_lora_rank": "null"}, False, None),
    "gqa-qknorm-dense": ({**GQA, "model.qk_norm": "true"}, False, None),
    "gqa-gelu-dense": ({**GQA, "model.activation": "gelu"}, False, None),
    "gqa-moe-softmax-zloss-capacity": ({**GQA, "moe.score_function": "softmax", "moe.num_groups": "null",
                                        "moe.topk_groups": "null", "moe.expert_bias": "false",
                                        "moe.z_loss_coeff": 0.01, "moe.capacity_factor": 1.0,
                                        "moe.num_shared_experts": 0}, True, None),
    "gqa-sinks-window-clamped-bias": ({**GQA, "model.attention_sinks": "true", "model.attention_bias": "true",
                                       "moe.activation": "swiglu_clamped", "moe.expert_linear_bias": "true",
                                       "moe.router_bias": "true", "moe.num_groups": 2, "moe.topk_groups": 1,
                                       "moe.group_score": "max"}, True, 5),
}


@pytest.mark.parametrize("b", [4, 2], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_saved_bytes_equal_formula(name, mode, b):
    over, moe, window = CASES[name]
    cfg = tiny(**over)
    measured = saved_bytes(cfg, moe, window, mode, DT[b])
    assert formula(cfg, moe, window, mode, b) == measured


@pytest.mark.parametrize("b", [4, 2], ids=["fp32", "bf16"])
def test_sink_attention_in_bands_saved_bytes_equal_formula(b):
    """A window short against the sequence: the sink attention's query blocks and key bands (3 x 128 queries)."""
    cfg = tiny(**GQA, **{"model.attention_sinks": "true", "train.seq_length": 300})
    assert formula(cfg, False, 7, "none", b, S=300) == saved_bytes(cfg, False, 7, "none", DT[b])


def test_gqa_dense_block_by_hand():
    """Hand count for one bf16 GQA + SwiGLU block (T=2*16, H=32, 4 heads / 2 kv of dim 8, F=48)."""
    cfg = tiny(**GQA)
    T, H, nh, kv, hd, F, S = 32, 32, 4, 2, 8, 48, 16
    norms = 2 * (8 * T * H + 4 * T + 4 * H)  # fp32 copy + normalised + rsqrt, fp32 weight copy
    attn = 2 * T * H + 4 * S * (hd // 2) * 2  # qkv input; cos/sin bf16 for q and k
    attn += 2 * T * nh * hd + 2 * 2 * T * kv * hd + 2 * T * nh * hd + 4 * T * nh  # q, k, v, out, lse
    mlp = 2 * T * H + 2 * T * 2 * F + 2 * T * F + 2 * T * F  # input, fc1 out, silu out, fc2 input
    assert formula(cfg, False, None, "none", 2) == norms + attn + mlp


def test_moe_routed_rows_scale_with_topk():
    cfg2, cfg4 = tiny(**{"moe.topk": 2}), tiny(**{"moe.topk": 4})
    M2, M4 = 32 * 2, 32 * 4
    # torch path: inverse idx, x rows, fc1 out, fc2 input, combine (mask, fp32 weight, FC2 output rows)
    cpu = A.Dims(B=2, S=16, b=2, device="cpu")
    per_row = 8 + 2 * 32 + 2 * 2 * 24 + 2 * 24 + 1 + 4 + 2 * 32
    assert [A.total(A.routed_experts(c, cpu)) for c in (cfg2, cfg4)] == [M2 * per_row, M4 * per_row]
    # fused path (CUDA, backend auto): int32 row index instead of the x rows, plus offs [E] int32; the
    # routing weights scale SwiGLU's rows (fp32 probs kept; the sort zeroes dropped ones: no mask), so the
    # combine keeps no FC2 output rows
    gpu = A.Dims(B=2, S=16, b=2, device="cuda")
    per_row = 8 + 4 + 2 * 2 * 24 + 2 * 24 + 4
    offs = 4 * cfg2.moe.num_experts
    assert [A.total(A.routed_experts(c, gpu)) for c in (cfg2, cfg4)] == [M2 * per_row + offs, M4 * per_row + offs]


def test_tensor_and_sequence_parallel_split():
    cfg = tiny(**GQA)
    full = A.total(A.block_terms(cfg, A.Dims(B=2, S=16, b=2), False, None, "none"))
    tp = A.total(A.block_terms(cfg, A.Dims(B=2, S=16, b=2, tp=2), False, None, "none"))
    sp = A.total(A.block_terms(cfg, A.Dims(B=2, S=16, b=2, tp=2, sp=True), False, None, "none"))
    assert sp < tp < full
    T, H = 32, 32
    # with SP only the two norms are halved: the q/k/v and FC1 inputs are kept gathered (distributed.tensor_parallel;
    # measured in tests/distributed/test_activations_tp.py)
    assert tp - sp == 2 * (8 * T * H + 4 * T) / 2


@pytest.mark.parametrize("t", [1, 2, 8])
def test_gpt_layer_with_selective_recompute_against_megatrons_34_sbh_over_t(t):
    """A plain GPT layer (bf16, MHA, GELU 4H) with TP + SP and selective recompute: (40 / t + 4) s b h against
    Megatron's 34 s b h / t (the activations module doc says where they differ), plus rsqrt, weight copies, and
    RoPE's bf16 tables where it runs eagerly (model.fused_rope off; the fused op keeps the shared fp32 tables)."""
    H, nh, S = 64, 8, 32
    cfg = tiny(**{**GQA, "model.hidden_size": H, "model.num_attention_heads": nh, "model.num_query_groups": nh,
                  "model.activation": "gelu", "model.ffn_hidden_size": 4 * H, "precision.dtype": "bf16"})
    d = A.Dims(B=1, S=S, b=2, tp=t, sp=t > 1, device="cuda")
    extras = 2 * (4 * S / t + 4 * H)  # the two norms' rsqrt and fp32 weight copies
    assert A.total(A.block_terms(cfg, d, False, None, "selective")) == (40 / t + 4) * S * H + extras
    eager = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fused_rope=False))
    rope = 2 * 2 * S * (H // nh // 2) * 2  # cos and sin in bf16, for q and for k
    assert A.total(A.block_terms(eager, d, False, None, "selective")) == (40 / t + 4) * S * H + extras + rope


def test_rope_terms_eager_and_fused():
    """RoPE with Qwen3's q/k norms (bf16, T = 32 tokens, 4 query / 2 kv heads of 8): eager keeps each norm's fp32
    input copy, normalised tensor, rsqrt and fp32 weight copy, and the bf16 tables per call; the fused op (CUDA)
    keeps q and k themselves and an fp32 rstd per row. Under tensor parallelism the norms run eagerly (DTensor
    weights); without the norm (and for MLA) the fused op keeps nothing of its own."""
    cfg = tiny(**{**GQA, "model.qk_norm": "true"})
    T, nh, kv, hd, S = 32, 4, 2, 8, 16
    rows = T * (nh + kv)
    eager = rows * (8 * hd + 4) + 2 * 4 * hd + 2 * 2 * S * (hd // 2) * 2
    gpu, cpu = A.Dims(B=2, S=S, b=2, device="cuda"), A.Dims(B=2, S=S, b=2, device="cpu")
    assert A.total(A.rope_terms(cfg, cpu)) == eager
    assert A.total(A.rope_terms(cfg, gpu)) == rows * (2 * hd + 4)
    off = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fused_rope=False))
    assert A.total(A.rope_terms(off, gpu)) == eager
    tp2 = A.Dims(B=2, S=S, b=2, tp=2, device="cuda")  # nh / 2, kv / 2 heads per rank, eager norms
    assert A.total(A.rope_terms(cfg, tp2)) == rows // 2 * (8 * hd + 4) + 2 * 4 * hd + 2 * 2 * S * (hd // 2) * 2
    assert A.total(A.rope_terms(tiny(**GQA), gpu)) == 0 and A.total(A.rope_terms(tiny(), gpu)) == 0


def test_context_parallel_halves_tokens():
    cfg = tiny(**{**GQA, "parallel.cp": 2, "parallel.dp": 2})
    d = A.resolve_dims(cfg)
    assert (d.S, d.T) == (8, 16)


@pytest.mark.parametrize("fused_loss", [False, True])
def test_mtp_and_model_level_saved_bytes(fused_loss):
    """The whole model (fp32, tiny MLA with MTP) keeps the blocks + head + MTP extras; with train.fused_loss the LM
    and MTP losses keep their dh and dW instead of the head input and the log-softmax."""
    cfg = tiny(**{"train.fused_loss": fused_loss, "model.hidden_size": 64})  # H != T: dh and dW differ from the
    # head input and the log-softmax the unfused loss keeps
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    labels = torch.randint(0, cfg.model.vocab_size, (2, 16))
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {ids.untyped_storage().data_ptr(), labels.untyped_storage().data_ptr()}
    tracker = StorageTracker(skip)

    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
        out = model(ids, labels)
    kept = tracker.alive_bytes()
    out.loss.backward()
    d = A.Dims(B=2, S=16, b=4, device="cpu")
    expected = sum(A.total(A.block_terms(cfg, d, cfg.is_moe_layer(i), None, "none")) for i in range(4))
    expected += A.total(A.block_terms(cfg, d, True, None, "none")) + A.total(A.mtp_extra_terms(cfg, d))
    expected += A.total(A.head_terms(cfg, d))
    rope = 2 * 16 * (cfg.model.qk_rope_head_dim // 2) * 4  # the model's shared fp32 cos/sin tables
    # labels reshaped for the loss and MTP targets/tokens are int64 [B, S] tensors: counted as "mtp tokens"
    assert kept == pytest.approx(expected + rope, rel=0.01)


def test_attention_kernel_choice():
    d16, d32 = A.Dims(B=1, S=8, b=2), A.Dims(B=1, S=8, b=4)
    assert A.attention_kernel(d16, gqa=True, same_dims=True, masked=False) == "fused"  # flash
    assert A.attention_kernel(d32, gqa=True, same_dims=True, masked=False) == "unfused"  # no fp32 flash, no GQA mem-eff
    assert A.attention_kernel(d32, gqa=False, same_dims=False, masked=True) == "fused"  # memory-efficient
    cpu = dataclasses.replace(d16, device="cpu")
    assert A.attention_kernel(cpu, gqa=False, same_dims=False, masked=False) == "unfused"


def test_fused_loss_chunk_transient_follows_the_path():
    """train.fused_loss's forward transient at V = 151936 (bf16, T = 8192): on a GPU the Triton kernels' chunk, 3x the
    tokens (1152) of bCV bytes (the gradient written over the logits), else PyTorch's 384 tokens of 6CV (fp32 copy,
    bf16 logits then gradient): no more bytes either way (runtime.loss_chunk); beside the fp32 dW accumulator."""
    cfg = tiny(**{"train.fused_loss": True, "model.vocab_size": 151936})
    H, V = cfg.model.hidden_size, 151936
    gpu = A.ce_transients(cfg, A.Dims(B=1, S=8192, b=2, device="cuda"))[0]
    cpu = A.ce_transients(cfg, A.Dims(B=1, S=8192, b=2, device="cpu"))[0]
    assert gpu == 2 * 1152 * V + 4 * V * H
    assert cpu == 6 * 384 * V + 4 * V * H
    assert gpu <= cpu
    assert A.ce_transients(cfg, A.Dims(B=1, S=8192, b=4, device="cuda"))[0] == 4 * 384 * V  # fp32: the same chunk
