"""Shared by the gloo training tests: the tiny preset's short run, its per-step records, running several
configurations in turn on the same spawned ranks, and the comparison with one process (1e-4 relative, fp32)."""

from __future__ import annotations

import json

import pytest
from gloo_ranks import run_ranks

from moetrain.config.load import load_config

STEPS = 3
BASE = [f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=16",
        "train.device=cpu", "checkpoint.save_final=false", "optim.warmup_steps=2"]
NO_MTP = ["model.mtp_num_layers=0"]
KEYS = ("loss", "grad_norm", "lm_loss", "aux_loss", "mtp_loss")


def cfg(out_dir, *overrides):
    return load_config(preset="tiny", overrides=[*BASE, f"train.out_dir={out_dir}", *overrides])


def records(result) -> list[list[float]]:
    return [[r[k] or 0.0 for k in KEYS] for r in result.records]


def single(out_dir, *overrides) -> list[list[float]]:
    """The one-process run's records."""
    from moetrain.train.trainer import run

    return records(run(cfg(out_dir, *overrides), show_progress=False))


def assert_match(got, want, what: str) -> None:
    assert len(got) == len(want) == STEPS, what
    for step, (g, w) in enumerate(zip(got, want), start=1):
        for name, a, b in zip(KEYS, g, w):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-7), f"{what}: step {step} {name}: {a} vs {b}"


def _train_all(rank, world_size, runs, result_file):
    """Every run of ``runs`` ({name: (out_dir, overrides)}) in turn on these ranks; rank 0 writes the records."""
    from moetrain.train.trainer import run

    results = {name: records(run(cfg(out, *ov), show_progress=False)) for name, (out, ov) in runs.items()}
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(results, f)


def train_on_ranks(tmp_path, runs: dict, world_size: int) -> dict:
    """{name: overrides} trained in turn on ``world_size`` gloo ranks (out_dir tmp_path/name): {name: records}."""
    result_file = tmp_path / "records.json"
    run_ranks(_train_all, {name: (str(tmp_path / name), ov) for name, ov in runs.items()}, str(result_file),
              world_size=world_size)
    return json.loads(result_file.read_text())
