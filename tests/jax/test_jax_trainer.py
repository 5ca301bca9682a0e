"""`moetrain train train.backend=jax`: learning, exact resume, checkpoints that resume in the other backend, and
the settings it refuses."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

from moetrain.config.load import load_config  # noqa: E402
from moetrain.errors import UserError  # noqa: E402
from moetrain.train import checkpoint as ckpt  # noqa: E402
from moetrain.train.trainer import run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def small(out_dir, *extra, backend="jax"):
    """The tiny preset shortened (as tests/unit/test_trainer.py's ``small``), in the given backend."""
    return load_config(overrides=[
        f"train.out_dir={out_dir}", "train.steps=20", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.seq_length=32", "optim.warmup_steps=2", f"train.backend={backend}", *extra])


def _rel(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def test_trains_tiny_with_falling_loss_and_complete_metrics(tmp_path):
    result = run(small(tmp_path, "train.steps=30", "train.micro_batch_size=4", "train.global_batch_size=8",
                       "train.seq_length=64"), show_progress=False)
    losses = [r["loss"] for r in result.records]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    first = records[0]
    assert first["mtp_loss"] is not None and first["grad_norm"] > 0 and len(first["load_imbalance"]) == 4
    assert not any(r["skipped"] for r in records)


def test_resume_gives_identical_losses(tmp_path):
    straight = run(small(tmp_path, "train.steps=5", "checkpoint.interval=3"), show_progress=False)
    resumed = run(small(tmp_path, "train.steps=5", f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_3'}"),
                  show_progress=False)
    assert [r["step"] for r in resumed.records] == [4, 5]
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in straight.records[3:]]  # bit-identical
    assert [r["grad_norm"] for r in resumed.records] == [r["grad_norm"] for r in straight.records[3:]]


@pytest.mark.parametrize("first,then", [("torch", "jax"), ("jax", "torch")])
def test_a_checkpoint_resumes_in_the_other_backend(tmp_path, first, then):
    """Steps 1-2 in one backend, 3-4 resumed from its checkpoint in the other, against 1-4 in the first alone:
    the same losses and gradient norms up to fp32 rounding (weights, Adam moments, step count, data position)."""
    straight = run(small(tmp_path / "straight", "train.steps=4", backend=first), show_progress=False)
    run(small(tmp_path / "mixed", "train.steps=2", backend=first), show_progress=False)
    resumed = run(small(tmp_path / "mixed", "train.steps=4", "checkpoint.resume=auto", backend=then),
                  show_progress=False)
    assert [r["step"] for r in resumed.records] == [3, 4]
    assert _rel([r["loss"] for r in resumed.records], [r["loss"] for r in straight.records[2:]]) < 1e-5
    assert _rel([r["grad_norm"] for r in resumed.records], [r["grad_norm"] for r in straight.records[2:]]) < 1e-4
    assert ckpt.list_checkpoints(tmp_path / "mixed")[-1].name == "step_4"


@pytest.mark.parametrize("override,named", [
    ("precision.fp8_recipe=rowwise", "precision.fp8_recipe"), ("train.fused_loss=true", "train.fused_loss"),
    ("train.compile=true", "train.compile"),
    ("parallel.dp=2", "parallel.dp = 2"), ("optim.exp_avg_sq_dtype=bf16", "optim.exp_avg_sq_dtype")])
def test_what_it_does_not_run_is_one_clear_error(tmp_path, override, named):
    with pytest.raises(UserError, match=named.replace(".", r"\.")):
        run(small(tmp_path, override), show_progress=False)


def test_from_hf_starts_from_the_same_weights_as_torch(tmp_path):
    """A tiny transformers DeepSeek-V3 as model.from_hf: the first step's loss is the torch backend's."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path / "hf")
    first = {}
    for backend in ("torch", "jax"):
        cfg = load_config(overrides=[f"model.from_hf={tmp_path / 'hf'}", f"train.out_dir={tmp_path / backend}",
                                     "train.steps=1", "train.micro_batch_size=2", "train.global_batch_size=2",
                                     "train.seq_length=16", f"train.backend={backend}"])
        first[backend] = run(cfg, show_progress=False).records[0]["loss"]
    assert abs(first["jax"] - first["torch"]) <= 1e-5 * first["torch"]


def test_without_jax_the_error_says_how_to_install(monkeypatch):
    from moetrain import jax as backend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flax" else real(name, *a))
    with pytest.raises(UserError, match=r'flax, which is not installed: pip install -e "\.\[jax\]"'):
        backend.require_jax()


def test_cli_trains_with_the_jax_backend(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moetrain", "train", "train.backend=jax", "train.steps=2",
                           "train.micro_batch_size=2", "train.global_batch_size=2", "train.seq_length=16",
                           f"train.out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "train.backend=jax" in proc.stderr
    assert (tmp_path / "checkpoints" / "step_2").is_dir()
