"""`model.from_hf` in configs (the conflict rule), training a converted model, `moetrain convert`."""

import argparse
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from moetrain.config.load import load_config  # noqa: E402
from moetrain.convert import register  # noqa: E402
from moetrain.errors import ConfigError, UserError  # noqa: E402
from moetrain.models.hf import from_hf  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
V = 64


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    """A tiny random DeepSeek-V3 (MLA, group routing, expert bias, shared expert) saved by transformers."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, bos_token_id=7, eos_token_id=9)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    path = tmp_path_factory.mktemp("hf") / "tiny-v3"
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return path


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


# ---- the conflict rule in load.py ----------------------------------------------------------------

def test_from_hf_sets_the_architecture_over_the_default_preset(v3_dir):
    cfg = load_config(overrides=[f"model.from_hf={v3_dir}", "train.steps=3"])
    # the implicit tiny preset (hidden 64, 4 layers, 512 vocab) is replaced without complaint
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size, cfg.model.kv_lora_rank) == (32, 2, V, 12)
    assert (cfg.moe.num_experts, cfg.moe.scaling_factor, cfg.model.mtp_num_layers) == (8, 2.5, 0)
    assert cfg.model.name == "tiny-v3" and cfg.train.steps == 3


def test_from_hf_conflicting_keys_name_both_values_and_sources(v3_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "run.yaml", f"""
        model: {{from_hf: {v3_dir}, hidden_size: 64}}
        """)
    with pytest.raises(ConfigError) as err:
        load_config("run.yaml")
    assert str(err.value) == (
        f"model.hidden_size = 64 (from run.yaml) conflicts with the architecture of model.from_hf: "
        f"{v3_dir / 'config.json'} gives 32; remove model.hidden_size or set it to 32")
    with pytest.raises(ConfigError, match=r"moe.topk = 3 \(from command line\) conflicts .* gives 2"):
        load_config(overrides=[f"model.from_hf={v3_dir}", "moe.topk=3"])
    # an explicitly chosen preset is the user's input too
    write(tmp_path / "p.yaml", f"extends: tiny\nmodel: {{from_hf: {v3_dir}}}\n")
    with pytest.raises(ConfigError, match=r"\(from preset tiny\) conflicts"):
        load_config("p.yaml")


def test_from_hf_agreeing_keys_training_keys_and_dropping_mtp(v3_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "run.yaml", f"""
        model: {{from_hf: {v3_dir}, hidden_size: 32, mtp_num_layers: 0, name: mine, init_std: 0.01}}
        moe: {{aux_loss_coeff: 0.5, score_function: sigmoid}}
        train: {{seq_length: 16}}
        """)
    cfg = load_config("run.yaml")
    assert (cfg.model.hidden_size, cfg.model.name, cfg.model.init_std, cfg.moe.aux_loss_coeff) == (32, "mine", 0.01, 0.5)
    assert cfg.model.num_layers == 2 and cfg.train.seq_length == 16
    with pytest.raises(ConfigError, match=r"model.from_hf = 'nowhere' \(from command line\): no such directory"):
        load_config(overrides=["model.from_hf=nowhere"])


def test_config_commands_with_from_hf_do_not_import_torch(v3_dir):
    code = (f"import sys; from moetrain.config.load import load_config; "
            f"c = load_config(overrides=['model.from_hf={v3_dir}']); "
            f"assert 'torch' not in sys.modules; print(c.model.hidden_size)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "32", out.stderr


# ---- training a converted model, and back to HF -----------------------------------------------------

def test_converted_model_continues_training_and_exports(v3_dir, tmp_path):
    from moetrain.convert import moetrain_to_hf
    from moetrain.train.data import build_data
    from moetrain.train.trainer import run

    cfg = load_config(overrides=[
        f"model.from_hf={v3_dir}", f"train.out_dir={tmp_path / 'run'}", "train.steps=3", "train.device=cpu",
        "train.micro_batch_size=2", "train.global_batch_size=2", "train.seq_length=16", "optim.warmup_steps=0",
        "optim.lr=1e-2", "optim.min_lr=1e-3"])
    # the loss of step 1 is the loss of the HF weights on the first batch: the weights were loaded
    ids, labels = build_data(cfg, V, "train").next_batch(2)
    with torch.no_grad():
        first = from_hf(v3_dir)(ids, labels).lm_loss.item()
    records = run(cfg, show_progress=False).records
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses)
    assert records[0]["lm_loss"] == pytest.approx(first, rel=1e-5)
    assert losses[-1] < losses[0]
    # the trainer checkpoint (and the run directory: its latest checkpoint) converts back to HF,
    # keeping the original config keys and tokenizer files
    out = moetrain_to_hf(tmp_path / "run", tmp_path / "hf_out")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["bos_token_id"], config["eos_token_id"]) == ("deepseek_v3", 7, 9)
    assert (out / "tokenizer_config.json").is_file()
    trained = torch.load(tmp_path / "run" / "checkpoints" / "step_3" / "model.pt", weights_only=True)
    ref = from_hf(v3_dir)
    ref.load_state_dict(trained)
    test_ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(test_ids).logits
        ours = ref(test_ids)
    assert ((hf_logits - ours).abs().max() / ours.abs().max()) < 1e-4


# ---- the CLI subcommands -----------------------------------------------------------------------------

def convert(*argv):
    parser = argparse.ArgumentParser(prog="moetrain")
    register(parser.add_subparsers(dest="command", required=True), None)
    args = parser.parse_args(["convert", *map(str, argv)])
    return args.func(args)


def test_convert_round_trip_through_a_moetrain_directory(v3_dir, tmp_path, capsys):
    mt = tmp_path / "mt"
    assert convert("hf-to-moetrain", "--hf-dir", v3_dir, "--out", mt, "--max-shard-size", "30KB") == 0
    assert "moetrain train --config" in capsys.readouterr().out
    cfg = load_config(str(mt / "config.yaml"))
    assert cfg.model.from_hf is None and (cfg.model.hidden_size, cfg.moe.num_experts) == (32, 8)
    index = json.loads((mt / "model.safetensors.index.json").read_text())
    assert "layers.1.mlp.experts.w1" in index["weight_map"] and "layers.1.mlp.router.expert_bias" in index["weight_map"]
    assert (mt / "hf_config.json").is_file() and (mt / "hf_files" / "tokenizer_config.json").is_file()
    # a moetrain directory is a valid model.from_hf / from_hf source, with the same logits
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(from_hf(mt)(ids), from_hf(v3_dir)(ids))
    assert load_config(overrides=[f"model.from_hf={mt}"]).model.kv_lora_rank == 12
    back = tmp_path / "back"
    assert convert("moetrain-to-hf", "--ckpt", mt, "--out", back) == 0
    original = load_file(v3_dir / "model.safetensors")
    written = load_file(back / "model.safetensors")
    assert sorted(original) == sorted(written) and all(torch.equal(original[k], written[k]) for k in original)
    assert json.loads((back / "config.json").read_text())["bos_token_id"] == 7
    with pytest.raises(UserError, match="is not empty"):
        convert("moetrain-to-hf", "--ckpt", mt, "--out", back)
    with pytest.raises(UserError, match="neither a moetrain model directory"):
        convert("moetrain-to-hf", "--ckpt", tmp_path, "--out", tmp_path / "x")
