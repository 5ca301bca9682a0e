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


def test_ep2_mesh_matches_one_device():
    proc = subprocess.run([sys.executable, str(HERE / "ep_mesh_main.py")], capture_output=True, text=True,
                          timeout=600, cwd=HERE.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [c["name"] for c in cases] == ["deepseek", "qwen3", "gptoss", "mixtral"]
    for c in cases:
        assert c["same_keys"] and c["w1_devices"] == 2, c
        assert abs(c["loss2"] - c["loss1"]) <= 1e-5 * abs(c["loss1"]), c
        assert c["grad_rel"] < 1e-5, c


def _rel(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def test_trainer_over_two_devices_matches_one_and_resumes_exactly(tmp_path):
    """parallel.dp=2 (data parallel, FSDP-style sharded weights) and dp=2 x ep=2 (experts over the same devices)
    train the tiny preset as one device does on the same global batches; the EP run resumes bit-exactly."""
    proc = subprocess.run([sys.executable, str(HERE / "mesh_train_main.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=900, cwd=HERE.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["name"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    one = runs["one"]
    for name in ("dp2", "dp2ep2"):
        assert runs[name]["steps"] == [1, 2, 3, 4]
        assert _rel(runs[name]["loss"], one["loss"]) < 1e-5, (name, runs[name]["loss"], one["loss"])
        assert _rel(runs[name]["grad_norm"], one["grad_norm"]) < 1e-4, name
    resumed = runs["dp2ep2_resumed"]
    assert resumed["steps"] == [3, 4]
    assert resumed["loss"] == runs["dp2ep2"]["loss"][2:] and resumed["grad_norm"] == runs["dp2ep2"]["grad_norm"][2:]
