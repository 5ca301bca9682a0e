"""Expert parallelism in the JAX backend: over a 2-device CPU mesh the loss and gradients equal one device's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402

from moetrain.jax.expert_parallel import peer_rows, send_slots  # noqa: E402

HERE = Path(__file__).resolve().parent


def test_send_slots_number_each_owners_rows_in_order():
    owner = jnp.array([1, 0, 1, 1, 0, 2])
    assert send_slots(owner, 3).tolist() == [0, 0, 1, 2, 1, 0]


def test_peer_rows_worst_case_and_capacity():
    assert peer_rows(T=16, K=4, EL=2, ep=4, capacity=None) == 32  # each token sends at most 2 rows to one peer
    assert peer_rows(T=16, K=4, EL=8, ep=4, capacity=1.5) == 24  # 1.5 x the even share 16 * 4 / 4
    assert peer_rows(T=16, K=4, EL=2, ep=4, capacity=10.0) == 32  # never above the worst case


def _rel(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def test_two_device_mesh_matches_one_device(tmp_path):
    """On a 2-device CPU mesh (mesh_main.py, one process): EP2 gives one device's loss and gradients for DeepSeek,
    GPT-OSS and Mixtral with a capacity; the trainer with parallel.dp=2 (FSDP-style weights) and dp=2 x ep=2 trains
    the tiny preset as one device does on the same global batches, compiling each step function once; the EP run
    resumes bit-exactly."""
    proc = subprocess.run([sys.executable, str(HERE / "mesh_main.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=900, cwd=HERE.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    models = [c for c in cases if c["kind"] == "model"]
    assert [c["name"] for c in models] == ["deepseek", "gptoss", "mixtral"]
    for c in models:
        assert c["same_keys"] and c["w1_devices"] == 2, c
        assert abs(c["loss2"] - c["loss1"]) <= 1e-5 * abs(c["loss1"]), c
        assert c["grad_rel"] < 1e-5, c
    runs = {c["name"]: c for c in cases if c["kind"] == "train"}
    for name, c in runs.items():  # the steps' outputs come back on their inputs' shardings: no step compiles twice
        assert c["compiles"] == {"grads": 1, "update": 1}, (name, c["compiles"])
    one = runs["one"]
    for name in ("dp2", "dp2ep2"):
        assert runs[name]["steps"] == [1, 2, 3]
        assert _rel(runs[name]["loss"], one["loss"]) < 1e-5, (name, runs[name]["loss"], one["loss"])
        assert _rel(runs[name]["grad_norm"], one["grad_norm"]) < 1e-4, name
    resumed = runs["dp2ep2_resumed"]
    assert resumed["steps"] == [3]
    assert resumed["loss"] == runs["dp2ep2"]["loss"][2:] and resumed["grad_norm"] == runs["dp2ep2"]["grad_norm"][2:]
