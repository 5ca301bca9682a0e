"""plan validate: the comparison table with a fake runner (no GPU needed), and the configs."""

import json

import pytest

from moetrain.errors import UserError
from moetrain.plan.hardware import load_hardware
from moetrain.plan.memory import project_memory
from moetrain.plan.validate import compare, run_validation, table, validation_config
from moetrain.plan.validate_configs import CONFIG_NAMES, VALIDATION_CONFIGS
from h200_measured import H200 as MEASURED  # this directory is on sys.path (pytest, no __init__.py)


def test_at_least_eight_configs_covering_the_space():
    assert len(CONFIG_NAMES) >= 8
    cfgs = {n: validation_config(n, 6, "x") for n in CONFIG_NAMES}
    assert any(not c.is_moe for c in cfgs.values()) and any(c.is_moe for c in cfgs.values())
    assert {c.train.recompute for c in cfgs.values()} == {"none", "selective", "full"}
    assert any(c.train.recompute_layer_ids for c in cfgs.values())
    assert {c.precision.dtype for c in cfgs.values()} == {"bf16", "fp32"}
    assert len({c.train.micro_batch_size for c in cfgs.values()}) >= 3
    assert len({c.train.seq_length for c in cfgs.values()}) >= 3
    assert any(c.model.name == "deepseek-v3" for c in cfgs.values())
    assert any(c.model.name == "qwen3-30b-a3b" for c in cfgs.values())
    for c in cfgs.values():  # each must fit one H200 (projected) and run on one device
        assert project_memory(c, load_hardware("h200")).verdict == "fits"
        assert c.checkpoint.save_final is False and c.train.device == "cuda"


def fake(name, steps, measure):
    if name == "llama3-8b-4l":
        return {"error": "worker exit 1: boom"}
    return {"peak_mem_gib": 50.0, "step_time_s": 0.2, "measured_blocks": {"moe": [0.005, 0.01], "dense": [0.004, 0.008]}}


def test_rows_errors_and_files(tmp_path, capsys):
    names = ["qwen3-4l", "llama3-8b-4l", "tiny-wide"]
    rows = run_validation(names, out_dir=str(tmp_path), runner=fake, require_gpu=False, steps=6)
    out, err = capsys.readouterr()
    assert [r["config"] for r in rows] == names
    q = rows[0]
    assert q["mem_err_pct"] == pytest.approx(100 * (q["proj_mem_gib"] / 50.0 - 1))
    assert q["time_err_roofline_pct"] == pytest.approx(100 * (q["proj_time_roofline_s"] / 0.2 - 1))
    assert q["proj_time_measured_s"] is not None and q["time_err_measured_pct"] is not None
    assert rows[1]["error"] == "worker exit 1: boom"
    assert "[2/3] llama3-8b-4l: worker exit 1: boom" in err
    assert "llama3-8b-4l" in out and "error: worker exit 1" in out and "worst |error|" in out
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert [r["config"] for r in saved] == names
    assert json.loads((tmp_path / "qwen3-4l.json").read_text())["measured"]["peak_mem_gib"] == 50.0


def test_table_formats_numbers():
    row = {"config": "x", "proj_mem_gib": 10.0, "meas_mem_gib": 10.5, "mem_err_pct": -4.76,
           "proj_time_roofline_s": 0.11, "proj_time_measured_s": None, "meas_time_s": 0.1,
           "time_err_roofline_pct": 10.0, "time_err_measured_pct": None, "error": None}
    text = table([row])
    assert "10.00" in text and "10.50" in text and "-4.8%" in text and "+10.0%" in text
    assert "worst |error|: memory 4.8%, time roofline 10.0%, time measured -%" in text


def test_compare_without_measured_blocks():
    _, step = MEASURED["tiny-wide"]
    proj = compare("tiny-wide", {}, load_hardware("h200"))["proj_mem_gib"]
    row = compare("tiny-wide", {"peak_mem_gib": proj * 1.25, "step_time_s": step}, load_hardware("h200"))
    assert row["proj_time_measured_s"] is None and row["time_err_measured_pct"] is None
    assert row["mem_err_pct"] == pytest.approx(-20.0)
    assert row["host_bound_pct"] > 50  # tiny-wide waits on kernel launches: the table says so
    assert "host-bound (" in table([row]) and "tiny-wide" in table([row]).splitlines()[-1]


def test_steps_must_allow_warmup():
    with pytest.raises(UserError, match="--steps = 2"):
        run_validation(["tiny-wide"], runner=fake, require_gpu=False, steps=2)


def test_config_table_is_data_only():
    assert all(isinstance(p, str) and isinstance(o, list) for p, o in VALIDATION_CONFIGS.values())
