"""HF export and `moetrain convert` under the things users hit: layer patterns a family cannot
hold, YaRN mscale, corrupt files, full or read-only disks, a mistyped --ckpt. Tiny models."""

import errno
import json
import math
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from moetrain import cli  # noqa: E402
from moetrain.errors import UserError  # noqa: E402
from moetrain.models.hf import export_hf, from_hf, save_moetrain_dir  # noqa: E402

from test_hf import perturbed_tiny  # noqa: E402  (this directory is on sys.path)

V = 64


def rel_err(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def tokens(seed=1, batch=2, seq=12):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def randomise(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """A tiny random Mixtral saved by transformers, with a tokenizer file beside it."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("hf") / "tiny-mixtral"
    randomise(transformers.MixtralForCausalLM(config).eval()).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return path


def one_line_error(capsys, argv):
    """Run the CLI; assert exit 2 and exactly one stderr line; return that line."""
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def tree(path):
    """Every file under path (relative name -> bytes): what a failed run must leave unchanged."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


# ---- save_moetrain_dir ---------------------------------------------------------------------------

def test_save_moetrain_dir_takes_hf_files_from_as_str(mixtral_dir, tmp_path):
    model = from_hf(mixtral_dir)
    out = save_moetrain_dir(model, model.cfg, tmp_path / "mt", hf_files_from=str(mixtral_dir))
    assert (out / "hf_files" / "tokenizer_config.json").read_bytes() == \
        (mixtral_dir / "tokenizer_config.json").read_bytes()
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(from_hf(out)(ids), model(ids))


# ---- corrupt safetensors headers -------------------------------------------------------------------

@pytest.fixture
def corrupt_dir(mixtral_dir, tmp_path):
    """The Mixtral checkpoint with its header length replaced by 2^62 (far beyond the file)."""
    path = tmp_path / "corrupt"
    shutil.copytree(mixtral_dir, path)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    weights.write_bytes(bytes(data))
    return path, f"{weights}: corrupt safetensors header: length {2**62} exceeds file size {len(data)}"


def test_corrupt_header_length_is_one_line_in_convert(corrupt_dir, tmp_path, capsys):
    path, message = corrupt_dir
    err = one_line_error(capsys, ["convert", "hf-to-moetrain", "--hf-dir", path, "--out", tmp_path / "out"])
    assert err == f"error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_corrupt_header_length_is_one_line_in_train(corrupt_dir, tmp_path, capsys):
    path, message = corrupt_dir
    err = one_line_error(capsys, ["train", f"model.from_hf={path}", "train.device=cpu", "train.steps=1",
                                  f"train.out_dir={tmp_path / 'run'}", "train.seq_length=8",
                                  "train.micro_batch_size=1", "train.global_batch_size=1"])
    assert err == f"error: {message}\n"
    with pytest.raises(UserError, match="corrupt safetensors header: length"):
        from_hf(path)


# ---- DeepSeek layer patterns ------------------------------------------------------------------------

def tiny_model(*overrides, seed=0):
    """The tiny preset (DeepSeek-V3-shaped, vocab 512) without MTP, every weight perturbed."""
    return perturbed_tiny("model.mtp_num_layers=0", *overrides, seed=seed)


def test_deepseek_export_refuses_a_layer_freq_transformers_ignores(tmp_path, capsys):
    model = tiny_model("model.num_layers=3", "moe.first_k_dense=0", "moe.layer_freq=2")  # MoE layers 0, 2
    src = save_moetrain_dir(model, model.cfg, tmp_path / "mt")
    err = one_line_error(capsys, ["convert", "moetrain-to-hf", "--ckpt", src, "--out", tmp_path / "hf"])
    assert err == ("error: moe.layer_freq = 2 cannot be written in the Hugging Face deepseek_v3 format: transformers "
                   "makes every layer from first_k_dense_replace on MoE (it ignores moe_layer_freq) but this model's "
                   "MoE layers are [0, 2] of 3; only moe.layer_freq = 1 (MoE on every layer from moe.first_k_dense "
                   "on) can be exported\n")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(UserError, match=r"moe\.layer_freq = 2 cannot be written in the Hugging Face deepseek_v2"):
        export_hf(model, model.cfg, tmp_path / "v2", model_type="deepseek_v2")
    assert not (tmp_path / "v2").exists()


def test_deepseek_layer_freq_that_changes_nothing_exports_and_loads_in_transformers(tmp_path):
    # 2 layers, first dense, layer_freq 3: layer 1 is the only MoE layer, as with layer_freq 1
    model = tiny_model("model.num_layers=2", "moe.first_k_dense=1", "moe.layer_freq=3")
    out = export_hf(model, model.cfg, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["first_k_dense_replace"], config["moe_layer_freq"]) == (1, 1)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        assert rel_err(theirs, ours) < 1e-4
        assert torch.equal(from_hf(out)(ids), ours)


def test_deepseek_moe_layer_freq_is_read_as_deepseeks_code_does():
    """DeepSeek's code (and vLLM / SGLang): layer i is MoE when i >= first_k_dense_replace and
    i % moe_layer_freq == 0. With 1 dense layer and freq 2 of 6 layers: MoE layers 2 and 4."""
    from moetrain.config.schema import Config
    from moetrain.models.hf_config import arch_from_hf

    hf = dict(model_type="deepseek_v2", vocab_size=V, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
              kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=48,
              n_routed_experts=4, moe_intermediate_size=16, num_experts_per_tok=2, first_k_dense_replace=1,
              moe_layer_freq=2)
    a = arch_from_hf(hf)
    cfg = Config()
    cfg.model.num_layers, cfg.moe.num_experts = 6, 4
    cfg.moe.first_k_dense, cfg.moe.layer_freq = a["moe.first_k_dense"], a["moe.layer_freq"]
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [2, 4]


# ---- YaRN mscale in a GQA family ------------------------------------------------------------------------

def test_gqa_yarn_mscale_exports_for_transformers_and_reimports(tmp_path):
    """Qwen3-MoE with YaRN (factor 4) and model.yarn_mscale = 0.8: transformers reads the export
    as our model, and our import gives back the same config and logits."""
    import copy

    from moetrain.models import build_model

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=40, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False)
    src = tmp_path / "qwen"
    randomise(transformers.Qwen3MoeForCausalLM(config).eval()).save_pretrained(src)
    plain = from_hf(src)
    cfg = copy.deepcopy(plain.cfg)
    cfg.model.rope_scaling, cfg.model.rope_scaling_factor, cfg.model.rope_original_max_position = "yarn", 4.0, 64
    cfg.model.yarn_mscale = 0.8
    model = build_model(cfg).eval()
    model.load_state_dict(plain.state_dict())
    out = export_hf(model, cfg, tmp_path / "hf", base_config=json.loads((src / "config.json").read_text()))
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope["attention_factor"] == pytest.approx(0.1 * 0.8 * math.log(4.0) + 1) and rope["mscale"] == 0.8
    ids = tokens()
    with torch.no_grad():
        ours = model(ids)
        assert rel_err(ours, plain(ids)) > 1e-2  # YaRN changes the logits: the comparison below means something
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        assert rel_err(theirs, ours) < 1e-4
        back = from_hf(out)
        assert back.cfg.model.yarn_mscale == 0.8 and back.cfg.model.rope_scaling_factor == 4.0
        assert torch.equal(back(ids), ours)
    # a config with attention_factor alone (no mscale): yarn_mscale solved from it
    hf = json.loads((out / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        del hf[key]["mscale"]
    (out / "config.json").write_text(json.dumps(hf))
    alone = from_hf(out)
    assert alone.cfg.model.yarn_mscale == pytest.approx(0.8, rel=1e-12)
    with torch.no_grad():
        assert rel_err(alone(ids), ours) < 1e-6


# ---- `moetrain convert`: OS failures are one line and leave nothing partial ----------------------------

def fail_on_shard(monkeypatch, n, code):
    """safetensors' save_file writes shards 1..n-1, then leaves a partial shard n and fails the way
    safetensors reports I/O errors (SafetensorError naming the os error)."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) < n:
            return real(tensors, filename, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code}) "
                              f'at path "{filename}"')

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return calls


def test_convert_disk_full_is_one_line_with_bytes_needed_and_leaves_nothing(mixtral_dir, tmp_path, monkeypatch,
                                                                            capsys):
    from moetrain.errors import format_bytes

    needed = sum(t.numel() * t.element_size() for t in from_hf(mixtral_dir).state_dict().values())
    calls = fail_on_shard(monkeypatch, 2, errno.ENOSPC)
    out = tmp_path / "new" / "out"
    err = one_line_error(capsys, ["convert", "hf-to-moetrain", "--hf-dir", mixtral_dir, "--out", out,
                                  "--max-shard-size", "20KB"])
    assert len(calls) == 2
    assert err.startswith(f"error: writing {out}: disk full ({out}/model-00002-of-")
    assert f".safetensors); needs {format_bytes(needed)}, " in err and err.endswith(" free; nothing was written\n")
    assert list(tmp_path.iterdir()) == []  # no output, no temporary directory, no parent made for it


def test_convert_force_into_a_full_disk_keeps_the_users_files(mixtral_dir, tmp_path, monkeypatch, capsys):
    model = from_hf(mixtral_dir)
    src = save_moetrain_dir(model, model.cfg, tmp_path / "mt")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "model.safetensors").write_bytes(b"an older export")
    before = tree(out)
    fail_on_shard(monkeypatch, 1, errno.ENOSPC)
    err = one_line_error(capsys, ["convert", "moetrain-to-hf", "--ckpt", src, "--out", out, "--force"])
    assert f"disk full ({out}/model.safetensors); needs " in err and err.endswith(f"; {out} is unchanged\n")
    assert tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mt"]


def test_convert_force_replaces_the_old_weights_and_keeps_other_files(mixtral_dir, tmp_path):
    from moetrain.convert import moetrain_to_hf

    model = from_hf(mixtral_dir)
    src = save_moetrain_dir(model, model.cfg, tmp_path / "mt")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    for stale in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                  "model.safetensors.index.json"):
        (out / stale).write_text("an older sharded export")
    moetrain_to_hf(src, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine\n"
    written, original = load_file(out / "model.safetensors"), load_file(mixtral_dir / "model.safetensors")
    assert sorted(written) == sorted(original) and all(torch.equal(written[k], original[k]) for k in original)
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(from_hf(out)(ids), model(ids))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mt"]


def test_convert_out_is_a_file_is_one_line(mixtral_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("a file\n")
    err = one_line_error(capsys, ["convert", "hf-to-moetrain", "--hf-dir", mixtral_dir, "--out", out])
    assert err == f"error: --out {out}: exists and is not a directory\n"
    assert out.read_text() == "a file\n"


def test_convert_read_only_file_system_is_one_line(mixtral_dir, tmp_path, monkeypatch, capsys):
    """The directory cannot be created (EROFS from mkdir, as a read-only mount gives even to root)."""
    real_mkdir, ro = os.mkdir, tmp_path / "ro"
    ro.mkdir()

    def mkdir(path, *args, **kwargs):
        if os.path.dirname(os.path.abspath(path)).startswith(str(ro)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    out = ro / "out"
    err = one_line_error(capsys, ["convert", "hf-to-moetrain", "--hf-dir", mixtral_dir, "--out", out])
    assert err == f"error: writing {out}: read-only file system ({ro}); nothing was written\n"
    assert list(ro.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 directory")
def test_convert_into_a_directory_without_write_permission_is_one_line(mixtral_dir, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    try:
        err = one_line_error(capsys, ["convert", "hf-to-moetrain", "--hf-dir", mixtral_dir, "--out", ro / "out"])
        assert err == f"error: writing {ro / 'out'}: permission denied ({ro}); nothing was written\n"
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o700)


# ---- --ckpt that does not exist ---------------------------------------------------------------------------

def test_missing_ckpt_suggests_the_one_run_beside_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    step = tmp_path / "runs" / "tiny" / "checkpoints" / "step_200"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (tmp_path / "runs" / "empty").mkdir()  # no checkpoints: not a candidate
    argv = ["convert", "moetrain-to-hf", "--ckpt", "runs/default", "--out", "hf"]
    assert one_line_error(capsys, argv) == "error: --ckpt runs/default: no such directory; did you mean runs/tiny?\n"
    other = tmp_path / "runs" / "other" / "checkpoints" / "step_1"
    other.mkdir(parents=True)
    (other / "meta.json").write_text("{}")
    assert one_line_error(capsys, argv) == "error: --ckpt runs/default: no such directory\n"
    assert not (tmp_path / "hf").exists()
