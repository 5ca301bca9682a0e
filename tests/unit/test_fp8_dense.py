"""precision.fp8_dense: the config names sizes torch._scaled_mm cannot take; the trainer refuses the run up front
without torchao; the attention, dense-MLP and shared-expert linears of the chosen layers become torchao's
Float8Linear with the state_dict unchanged; the tiny model trains with them (on the CPU through torch's CPU
_scaled_mm) close to the 32-bit run and resumes from its own checkpoint."""

import importlib.util

import pytest

from moetrain.config.load import load_config
from moetrain.errors import ConfigError, UserError
from moetrain.train import fp8_dense

# tiny's MLA kv_a_proj has kv_lora_rank + qk_rope_head_dim = 32 + 8 outputs; 16 makes every size a multiple of 16
SIZES_16 = "model.qk_rope_head_dim=16"


def _cfg(tmp_path, *overrides):
    return load_config(preset="tiny", overrides=[
        "train.steps=3", "optim.warmup_steps=1", "train.global_batch_size=4", "train.micro_batch_size=2",
        "train.seq_length=32", f"train.out_dir={tmp_path}", "train.device=cpu", "checkpoint.save_final=false",
        SIZES_16, *overrides])


def test_sizes_that_are_not_multiples_of_16_are_refused_by_key(tmp_path):
    with pytest.raises(ConfigError, match=r"precision.fp8_dense = rowwise needs the converted linears' sizes to be "
                                          r"multiples of 16 \(torch._scaled_mm\); model.kv_lora_rank \+ "
                                          r"model.qk_rope_head_dim = 40 is not"):
        _cfg(tmp_path, "precision.fp8_dense=rowwise", "model.qk_rope_head_dim=8")
    with pytest.raises(ConfigError, match=r"train.micro_batch_size x train.seq_length \(tokens\) = 60"):
        _cfg(tmp_path, "precision.fp8_dense=tensorwise", "train.seq_length=30")
    _cfg(tmp_path, "model.qk_rope_head_dim=8")  # fp8_dense=none: no size rule


def test_the_dense_layer_kept_in_bf16_is_not_checked_but_a_converted_one_is(tmp_path):
    odd = "model.ffn_hidden_size=200"  # tiny's layer 0 is its one dense MLP
    _cfg(tmp_path, "precision.fp8_dense=tensorwise", odd)
    with pytest.raises(ConfigError, match="model.ffn_hidden_size = 200 is not"):
        _cfg(tmp_path, "precision.fp8_dense=tensorwise", "precision.fp8_dense_bf16_edges=false", odd)


def test_nothing_to_convert_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="converts nothing: precision.fp8_dense_bf16_edges keeps every layer of "
                                          "model.num_layers = 2"):
        _cfg(tmp_path, "precision.fp8_dense=tensorwise", "model.num_layers=2", "model.mtp_num_layers=0")


def test_unknown_recipe_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="precision.fp8_dense"):
        _cfg(tmp_path, "precision.fp8_dense=blockwise")


def test_layers_in_fp8_keep_the_edges_by_default(tmp_path):
    cfg = _cfg(tmp_path, "precision.fp8_dense=tensorwise")
    assert cfg.fp8_dense_layers() == [1, 2, 4]  # 4 layers, then MTP depth 0 as block 4
    cfg = _cfg(tmp_path, "precision.fp8_dense=tensorwise", "precision.fp8_dense_bf16_edges=false")
    assert cfg.fp8_dense_layers() == [0, 1, 2, 3, 4]
    assert _cfg(tmp_path).fp8_dense_layers() == []


def test_without_torchao_the_run_stops_before_anything_is_made(tmp_path, monkeypatch):
    from moetrain.train.trainer import Trainer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"precision.fp8_dense = tensorwise needs torchao's float8 training: "
                                        r"pip install torchao"):
        Trainer(_cfg(out, "precision.fp8_dense=tensorwise"))
    assert not out.exists()
    Trainer(_cfg(out))  # fp8_dense=none needs no torchao


def test_which_module_names_convert(tmp_path):
    cfg = _cfg(tmp_path, "precision.fp8_dense=tensorwise")
    layers = frozenset(cfg.fp8_dense_layers())
    yes = ["layers.1.attn.q_a_proj", "layers.2.attn.o_proj", "layers.1.mlp.shared.down_proj",
           "mtp.0.block.attn.kv_b_proj", "mtp.0.block.mlp.shared.gate_proj"]
    no = ["layers.0.attn.q_a_proj", "layers.0.mlp.up_proj", "layers.3.attn.o_proj", "head", "mtp.0.eh_proj",
          "layers.1.mlp.router", "layers.1.mlp.experts", "embed"]
    assert [n for n in yes if not fp8_dense.converts(n, cfg, layers)] == []
    assert [n for n in no if fp8_dense.converts(n, cfg, layers)] == []


def _linears(model):
    from torch import nn

    return {name: type(mod).__name__ for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


@pytest.mark.parametrize("edges", [True, False])
def test_conversion_swaps_exactly_the_dense_linears_and_keeps_the_state_dict(edges, tmp_path):
    pytest.importorskip("torchao")
    import torch

    from moetrain.models import build_model

    cfg = _cfg(tmp_path, "precision.fp8_dense=tensorwise", f"precision.fp8_dense_bf16_edges={str(edges).lower()}")
    torch.manual_seed(0)
    model = build_model(cfg)
    before = model.state_dict()
    rng = torch.random.get_rng_state()
    converted = fp8_dense.apply_fp8_dense(model, cfg)
    assert torch.equal(rng, torch.random.get_rng_state())  # the swap draws nothing
    kinds = _linears(model)
    assert sorted(converted) == sorted(n for n, k in kinds.items() if k == "Float8Linear")
    blocks = {fp8_dense.block_of(n, cfg.model.num_layers)[0] for n in converted}
    assert blocks == set(cfg.fp8_dense_layers())
    assert ("layers.0.mlp.up_proj" in converted) == (not edges)
    assert kinds["head"] == kinds["mtp.0.eh_proj"] == "Linear"
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in before)


def test_conversion_on_meta_then_init_gives_the_unconverted_weights(tmp_path):
    """The distributed trainer converts the meta model before FSDP, then materialises and initialises it."""
    pytest.importorskip("torchao")
    import torch

    from moetrain.models import build_model

    cfg = _cfg(tmp_path, "precision.fp8_dense=rowwise")
    torch.manual_seed(0)
    plain = build_model(cfg)
    meta = build_model(cfg, device="meta")
    assert fp8_dense.apply_fp8_dense(meta, cfg)
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.init_weights()
    want = plain.state_dict()
    got = meta.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _cpu_rowwise_scaled_mm(tmp_path) -> bool:
    import torch

    try:
        fp8_dense.require_scaled_mm(_cfg(tmp_path, "precision.fp8_dense=rowwise"), torch.device("cpu"))
    except UserError:
        return False
    return True


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_dense_trains_like_the_32_bit_run(recipe, tmp_path):
    pytest.importorskip("torchao")
    from moetrain.train.trainer import run

    if recipe == "rowwise" and not _cpu_rowwise_scaled_mm(tmp_path):
        pytest.skip("this torch's CPU torch._scaled_mm scales per tensor only (the trainer refuses rowwise here)")

    def losses(out, *overrides):
        return [r["loss"] for r in run(_cfg(out, *overrides), show_progress=False).records]

    full = losses(tmp_path / "fp32")
    fp8 = losses(tmp_path / "fp8", f"precision.fp8_dense={recipe}")
    assert fp8 != full  # the dense linears really ran in FP8
    for step, (a, b) in enumerate(zip(fp8, full), start=1):
        assert a == pytest.approx(b, rel=0.01), f"step {step}"


def test_checkpoint_with_fp8_dense_resumes_with_it_and_holds_the_plain_keys(tmp_path):
    pytest.importorskip("torchao")
    import torch

    from moetrain.models import build_model
    from moetrain.train import checkpoint as ckpt
    from moetrain.train.trainer import run

    on = ["precision.fp8_dense=tensorwise", "checkpoint.interval=2"]
    straight = run(_cfg(tmp_path, *on), show_progress=False)
    step_2 = tmp_path / "checkpoints" / "step_2"
    resumed = run(_cfg(tmp_path, *on, f"checkpoint.resume={step_2}"), show_progress=False)
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in straight.records[2:]]
    saved = ckpt.load_checkpoint(step_2)["model"]
    with torch.device("meta"):
        plain = build_model(_cfg(tmp_path)).state_dict()
    assert sorted(saved) == sorted(plain)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_dense_trains_like_bf16_on_gpu(recipe, tmp_path):
    """bf16 on CUDA, torch._scaled_mm on the tensor cores: the losses stay within FP8 noise of the bf16 run."""
    pytest.importorskip("torchao")
    from moetrain.train.trainer import run

    def losses(out, *overrides):
        cfg = load_config(preset="tiny", overrides=[f"train.out_dir={out}", "train.device=cuda", "train.steps=8",
                                                    "checkpoint.save_final=false", SIZES_16, *overrides])
        return [r["loss"] for r in run(cfg, show_progress=False).records]

    bf16 = losses(tmp_path / "bf16")
    fp8 = losses(tmp_path / "fp8", f"precision.fp8_dense={recipe}")
    assert fp8 != bf16
    assert fp8 == pytest.approx(bf16, rel=3e-2)
