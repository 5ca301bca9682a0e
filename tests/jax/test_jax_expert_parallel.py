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
