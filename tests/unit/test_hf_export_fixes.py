"""HF export and `moetrain convert` under the things users hit: layer patterns a family cannot
hold, YaRN mscale, corrupt files, full or read-only disks, a mistyped --ckpt. Tiny models."""

import errno
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from moetrain import cli  # noqa: E402
from moetrain.errors import UserError  # noqa: E402
from moetrain.models.hf import export_hf, from_hf, save_moetrain_dir  # noqa: E402

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
