"""`moetrain train` on 2 and 4 gloo ranks (FSDP2, expert parallelism, HSDP) against one process on the same global
batch and seed: per-step loss and gradient norm within 1e-4 relative (fp32, CPU), and the same trained weights'
loss afterwards (the expert bias moved alike on every rank)."""

import json

import pytest
from gloo_ranks import run_ranks

from moetrain.config.load import load_config

STEPS = 6


def _cfg(out_dir, *overrides):
    return load_config(preset="tiny", overrides=[
        f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=16",
        f"train.out_dir={out_dir}", "train.device=cpu", "checkpoint.save_final=false", "optim.warmup_steps=2",
        *overrides])


def _records(result):
    return [(r["loss"], r["grad_norm"], r["lm_loss"], r["aux_loss"]) for r in result.records]


def _train_ranks(rank, world_size, out_dir, overrides, result_file):
    from moetrain.train.trainer import run

    result = run(_cfg(out_dir, *overrides), show_progress=False)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(_records(result), f)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    from moetrain.train.trainer import run

    out = tmp_path_factory.mktemp("single")
    return _records(run(_cfg(out), show_progress=False))


LAYOUTS = {
    "world1": (1, []),  # torchrun --nproc_per_node 1: the distributed trainer on one process
    "dp2": (2, ["parallel.dp=2"]),
    "ep2": (2, ["parallel.dp=2", "parallel.ep=2"]),
    "ep2_dp2": (4, ["parallel.dp=4", "parallel.ep=2"]),
    "ep2_sync_free": (2, ["parallel.dp=2", "parallel.ep=2", "moe.dispatcher=sync_free"]),
    "hsdp2x2": (4, ["parallel.dp=4", "parallel.dp_replicate=2"]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_training_matches_one_process(layout, single, tmp_path):
    world_size, overrides = LAYOUTS[layout]
    result_file = tmp_path / "records.json"
    run_ranks(_train_ranks, str(tmp_path / "run"), overrides, str(result_file), world_size=world_size)
    got = json.loads(result_file.read_text())
    assert len(got) == len(single) == STEPS
    for step, (g, want) in enumerate(zip(got, single), start=1):
        for name, a, b in zip(("loss", "grad_norm", "lm_loss", "aux_loss"), g, want):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-7), f"step {step} {name}: {a} vs {b}"


def test_fp8_dense_on_two_ranks_matches_one_process(tmp_path):
    """precision.fp8_dense under FSDP2 and expert parallelism: the trainer converts the meta model before sharding,
    and each rank's Float8Linear sees the all-gathered weight: the first step matches one process with FP8 exactly,
    the later ones within 1e-3."""
    pytest.importorskip("torchao")
    from moetrain.train.trainer import run

    fp8 = ["precision.fp8_dense=tensorwise", "model.qk_rope_head_dim=16"]  # every converted size a multiple of 16
    want = _records(run(_cfg(tmp_path / "single", *fp8), show_progress=False))
    result_file = tmp_path / "records.json"
    run_ranks(_train_ranks, str(tmp_path / "run"), ["parallel.dp=2", "parallel.ep=2", *fp8], str(result_file),
              world_size=2)
    got = json.loads(result_file.read_text())
    assert len(got) == STEPS
    # the first forward is FP8's exactly (the fp32 run's differs by ~1e-4); then the gradients, summed in another
    # order, leave the weights a rounding apart, enough to round some FP8 values the other way (~2e-4 by step 6)
    assert got[0][0] == pytest.approx(want[0][0], rel=1e-6)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g[0] == pytest.approx(w[0], rel=1e-3), f"step {step} loss"
