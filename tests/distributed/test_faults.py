"""A failing rank brings the whole job down: torchrun on 2 gloo ranks, one rank raising, killed with SIGKILL, or
hanging at step 2; the job exits non-zero within train.dist_timeout_s (plus start-up) with one error printed."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("fault_worker.py")
TIMEOUT_S = 8
START_UP_S = 90  # two ranks importing torch and building the model on a loaded 2-core machine


def _torchrun(tmp_path, kind: str, *extra: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           kind, "1", "2", "train", "--preset", "tiny", "train.steps=4", "train.global_batch_size=2",
           "train.micro_batch_size=1", "train.seq_length=16", "train.device=cpu", "parallel.dp=2",
           f"train.dist_timeout_s={TIMEOUT_S}", f"train.out_dir={tmp_path / 'run'}", "checkpoint.save_final=false", *extra]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=START_UP_S + 4 * TIMEOUT_S,
                          env={**_env(), "OMP_NUM_THREADS": "1"})
    return proc, time.monotonic() - started


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


@pytest.mark.parametrize("kind", ["raise", "kill", "hang"])
def test_a_failing_rank_ends_the_job_with_one_error(kind, tmp_path):
    proc, seconds = _torchrun(tmp_path, kind)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert seconds < START_UP_S + 2 * TIMEOUT_S, out
    errors = [line for line in out.splitlines() if line.startswith("error: rank")]
    if kind == "raise":
        assert errors == ["error: rank 1 of 2: RuntimeError: injected fault"], out
    elif kind == "kill":  # rank 1 cannot speak; torchrun names it, and rank 0 may first say it lost its peer
        assert "SIGKILL" in out, out
        assert len(errors) <= 1 and all(e.startswith("error: rank 0 of 2: a collective failed") for e in errors), out
    else:
        assert len(errors) == 1 and errors[0].startswith("error: rank 0 of 2: a collective failed"), out


def test_a_stop_signal_on_one_rank_stops_every_rank_after_the_same_step_and_saves(tmp_path):
    from moetrain.train import checkpoint as ckpt

    proc, _ = _torchrun(tmp_path, "term")
    out = proc.stdout + proc.stderr
    assert "interrupted: checkpoint saved at step 2" in out, out
    saved = ckpt.list_checkpoints(tmp_path / "run")
    assert [p.name for p in saved] == ["step_2"] and ckpt.verify(saved[0]) is None, out
    assert ckpt.read_meta(saved[0])["world_size"] == 2
