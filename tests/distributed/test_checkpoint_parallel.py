"""Sharded checkpoints on gloo ranks: saved under one layout, resumed under another (EP2 x DP2 -> EP4, 4 ranks ->
one process, one process -> EP2 x DP2), the resumed steps match an uninterrupted single-process run within 1e-4
relative; a damaged shard is caught and resume=auto falls back to the previous checkpoint."""

import json
import shutil

import pytest
from gloo_ranks import run_ranks

from moetrain.config.load import load_config
from moetrain.train import checkpoint as ckpt

STEPS = 4
EP2_DP2 = ["parallel.dp=4", "parallel.ep=2"]


def _cfg(out_dir, *overrides):
    return load_config(preset="tiny", overrides=[
        f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=16",
        f"train.out_dir={out_dir}", "train.device=cpu", "checkpoint.interval=2", "checkpoint.save_final=false",
        "optim.warmup_steps=2", *overrides])


def _records(result):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in result.records]


def _train(out_dir, overrides):
    from moetrain.train.trainer import run

    return _records(run(_cfg(out_dir, *overrides), show_progress=False))


def _train_ranks(rank, world_size, out_dir, overrides, result_file):
    records = _train(out_dir, overrides)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(records, f)


def _ranks(tmp_path, name, world_size, overrides):
    result_file = tmp_path / f"{name}.json"
    run_ranks(_train_ranks, str(tmp_path / name), overrides, str(result_file), world_size=world_size)
    return json.loads(result_file.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, 4 steps, format-2 checkpoints at steps 2 and 4: (its out_dir, its records)."""
    out = tmp_path_factory.mktemp("single")
    return out, _train(out, [])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """EP2 x DP2 on 4 ranks, 4 steps, sharded checkpoints at steps 2 and 4: its out_dir (and records, kept
    beside it)."""
    tmp = tmp_path_factory.mktemp("sharded")
    records = _ranks(tmp, "run", 4, EP2_DP2)
    (tmp / "records.json").write_text(json.dumps(records))
    return tmp / "run"


def _assert_resumed_match(got, reference):
    assert [r[0] for r in got] == [3, 4], got
    for (step, loss, norm), (_, want_loss, want_norm) in zip(got, reference[2:]):
        assert loss == pytest.approx(want_loss, rel=1e-4), f"step {step} loss"
        assert norm == pytest.approx(want_norm, rel=1e-4), f"step {step} grad norm"


def test_sharded_checkpoint_is_format_3_with_a_manifest_over_every_rank(sharded):
    path = sharded / "checkpoints" / "step_2"
    meta = ckpt.read_meta(path)
    assert meta["format_version"] == ckpt.SHARDED_FORMAT and meta["world_size"] == 4
    assert meta["layout"]["ep"] == 2
    files = json.loads((path / ckpt.MANIFEST).read_text())["files"]
    assert {f"trainer/rank_{r}.pt" for r in range(4)} <= set(files)
    assert "state/.metadata" in files and sum(name.endswith(".distcp") for name in files) == 4
    assert ckpt.verify(path) is None


def test_same_layout_resume_is_bit_exact(sharded, tmp_path):
    resume = f"checkpoint.resume={sharded / 'checkpoints' / 'step_2'}"
    got = _ranks(tmp_path, "again", 4, [*EP2_DP2, resume])
    uninterrupted = json.loads((sharded.parent / "records.json").read_text())
    assert [tuple(r) for r in got] == [tuple(r) for r in uninterrupted[2:]]


def test_ep2_dp2_checkpoint_resumes_under_ep4(sharded, single, tmp_path):
    resume = f"checkpoint.resume={sharded / 'checkpoints' / 'step_2'}"
    got = _ranks(tmp_path, "ep4", 4, ["parallel.dp=4", "parallel.ep=4", resume])
    _assert_resumed_match(got, single[1])


def test_four_rank_checkpoint_resumes_in_one_process(sharded, single, tmp_path):
    got = _train(tmp_path / "one", [f"checkpoint.resume={sharded / 'checkpoints' / 'step_2'}"])
    _assert_resumed_match(got, single[1])


def test_single_device_checkpoint_resumes_under_ep2_dp2(single, tmp_path):
    out, reference = single
    got = _ranks(tmp_path, "ep2dp2", 4, [*EP2_DP2, f"checkpoint.resume={out / 'checkpoints' / 'step_2'}"])
    _assert_resumed_match(got, reference)


def test_a_damaged_shard_is_caught_and_auto_falls_back(sharded, single, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(sharded, out)
    shard = sorted((out / "checkpoints" / "step_4" / "state").glob("*.distcp"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "does not match its checksum" in ckpt.verify(out / "checkpoints" / "step_4")
    result_file = tmp_path / "fallback.json"
    run_ranks(_train_ranks, str(out), ["parallel.dp=2", "parallel.ep=2", "checkpoint.resume=auto"],
              str(result_file), world_size=2)
    _assert_resumed_match(json.loads(result_file.read_text()), single[1])
