"""Atomic checkpoints: a crash mid-save leaves the previous checkpoint loadable."""

import pytest
import torch

from moetrain.errors import UserError
from moetrain.train import checkpoint as ckpt


def save(out, step, value, **kw):
    return ckpt.save_checkpoint(
        out, step, model_state={"w": torch.full((3,), float(value))}, optimizer_state={"step": step},
        trainer_state={"step": step, "rng": ckpt.rng_state()}, config_yaml=f"step: {step}\n", **kw)


def test_save_load_and_auto_resume(tmp_path):
    assert ckpt.resolve_resume("auto", tmp_path) is None
    assert ckpt.resolve_resume(None, tmp_path) is None
    save(tmp_path, 5, 1.0)
    save(tmp_path, 10, 2.0)
    latest = ckpt.resolve_resume("auto", tmp_path)
    assert latest.name == "step_10"
    state = ckpt.load_checkpoint(latest, torch.device("cpu"))
    assert torch.equal(state["model"]["w"], torch.full((3,), 2.0))
    assert state["trainer"]["step"] == 10 and state["meta"]["step"] == 10
    assert (latest / "config.yaml").read_text() == "step: 10\n"


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    save(tmp_path, 10, 1.0)
    real = ckpt._save_file

    def dying(obj, path):
        if path.name == "optimizer.pt":
            raise KeyboardInterrupt("killed mid-save")
        real(obj, path)

    monkeypatch.setattr(ckpt, "_save_file", dying)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 20, 2.0)
    monkeypatch.setattr(ckpt, "_save_file", real)
    root = ckpt.checkpoint_root(tmp_path)
    assert (root / "step_20.partial" / "model.pt").exists()  # the partial write is there ...
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_10"]  # ... and ignored
    state = ckpt.load_checkpoint(ckpt.resolve_resume("auto", tmp_path), torch.device("cpu"))
    assert torch.equal(state["model"]["w"], torch.full((3,), 1.0))
    save(tmp_path, 20, 3.0)  # the next save clears the leftover
    assert not (root / "step_20.partial").exists()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_10", "step_20"]


def test_keep_last_prunes_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, step, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_3", "step_4"]


def test_explicit_resume_path_must_be_complete(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(UserError, match="not a complete checkpoint"):
        ckpt.resolve_resume(str(tmp_path / "nothing"), tmp_path)
    path = save(tmp_path, 3, 0.0)
    assert ckpt.resolve_resume(str(path), "elsewhere") == path


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    a = torch.rand(4)
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(4), a)
