"""scripts/plan_calibrate.py's CPU half: the roofline's view of each calibration config (the GPU half is run
by the device scripts). Keeps the script in step with the planner's API."""

import importlib.util
from pathlib import Path

import pytest

from moetrain.plan.validate_configs import VALIDATION_CONFIGS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plan_calibrate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("plan_calibrate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_calibration_configs_are_not_validation_configs():
    cal = load_script().CONFIGS
    assert not set(cal) & set(VALIDATION_CONFIGS)
    assert not {tuple([p] + o) for p, o in cal.values()} & {tuple([p] + o) for p, o in VALIDATION_CONFIGS.values()}


@pytest.mark.parametrize("name", ["cal-tiny", "cal-dsv3-32e"])
def test_projection_has_phases_kinds_and_components(name):
    mod = load_script()
    p = mod.projected(name)
    assert p["fwd_ms"] > 0 and p["bwd_ms"] > p["fwd_ms"] * 0.5 and p["step_ms"] >= p["fwd_ms"] + p["bwd_ms"]
    assert set(p["kernels_ms"]) == {"gemm", "attention", "elementwise"}
    layers = [k for k in p["components"] if k.startswith("layer")]
    assert layers and "head" in p["components"]
    for c in p["components"].values():
        assert c["fwd_ms"] >= c["fwd_gpu_ms"] > 0 and c["bwd_ms"] >= c["bwd_gpu_ms"] > 0


def test_trainer_step_is_the_median_of_the_trainers_steps_after_warmup(monkeypatch):
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from moetrain.train import trainer

    seen = {}

    def fake_run(cfg, show_progress):
        seen.update(steps=cfg.train.steps, device=cfg.train.device, preset=cfg.model.name)
        times = [9.0, 9.0, 9.0, 9.0, 0.5, 0.1, 0.3, 0.2, 0.4]  # four warm-up steps, then the median is 0.3 s
        return SimpleNamespace(records=[{"step_time_s": t} for t in times])

    monkeypatch.setattr(trainer, "run", fake_run)
    out = load_script().trainer_step("cal-tiny", steps=9, device="cpu")
    assert out["trainer_step_ms"] == pytest.approx(300.0)
    assert seen == {"steps": 9, "device": "cpu", "preset": "tiny"}


def test_trainer_step_runs_the_real_trainer():
    pytest.importorskip("torch")
    out = load_script().trainer_step("cal-tiny", steps=2, device="cpu")
    assert 0 < out["trainer_step_ms"] < 60_000  # two tiny CPU steps: milliseconds to seconds
