"""model.from_hf into a sharded model: EP2 x DP2 on 4 gloo ranks, each rank reading only the experts it holds and
its slices of the dense tensors, and PP2 on 2 (each pipeline rank reading its stage's tensors), train like one
process loading the same Hugging Face checkpoint."""

import json

import pytest
import torch
from gloo_ranks import run_ranks

from moetrain.config.load import load_config

STEPS = 2


def _cfg(out_dir, hf_dir, *overrides):
    return load_config(preset="tiny", overrides=[
        f"model.from_hf={hf_dir}", f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1",
        "train.seq_length=16", f"train.out_dir={out_dir}", "train.device=cpu", "checkpoint.save_final=false",
        *overrides])


def _records(result):
    return [(r["loss"], r["grad_norm"]) for r in result.records]


def _train_ranks(rank, world_size, out_dir, hf_dir, overrides, result_file):
    from moetrain.train.trainer import run

    records = _records(run(_cfg(out_dir, hf_dir, *overrides), show_progress=False))
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(records, f)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny preset's architecture in Hugging Face (DeepSeek-V3) format, weights unlike any seed's init."""
    from moetrain.models import build_model
    from moetrain.models.hf import export_hf

    cfg = load_config(preset="tiny")
    torch.manual_seed(123)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("hf") / "tiny-hf"
    export_hf(model, cfg, out)
    return out


def test_hf_weights_load_into_ep2_dp2_shards_as_into_one_process(hf_dir, tmp_path):
    from moetrain.train.trainer import run

    one = _records(run(_cfg(tmp_path / "one", hf_dir), show_progress=False))
    fresh = _records(run(load_config(preset="tiny", overrides=[
        f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=16",
        f"train.out_dir={tmp_path / 'fresh'}", "train.device=cpu", "checkpoint.save_final=false"]),
        show_progress=False))
    assert one[0][0] != pytest.approx(fresh[0][0], rel=1e-3)  # the import changed the weights
    result_file = tmp_path / "ranks.json"
    run_ranks(_train_ranks, str(tmp_path / "ranks"), str(hf_dir), ["parallel.dp=4", "parallel.ep=2"],
              str(result_file), world_size=4)
    got = json.loads(result_file.read_text())
    for step, (g, want) in enumerate(zip(got, one), start=1):
        assert g == pytest.approx(want, rel=1e-4), f"step {step}"
    run_ranks(_train_ranks, str(tmp_path / "pp"), str(hf_dir), ["parallel.pp=2"], str(result_file), world_size=2)
    got = json.loads(result_file.read_text())
    for step, (g, want) in enumerate(zip(got, one), start=1):
        assert g == pytest.approx(want, rel=1e-4), f"PP2 step {step}"
