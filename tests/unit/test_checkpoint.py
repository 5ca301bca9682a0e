"""Checkpoints: atomic, verified by their manifest, loadable without running code, never left partial."""

import errno
import json
import pickle

import pytest
import torch

from moetrain.errors import UserError
from moetrain.train import checkpoint as ckpt


def save(out, step, value, run_id="run-a", **kw):
    return ckpt.save_checkpoint(
        out, step, model_state={"w": torch.full((3,), float(value))}, optimizer_state={"step": step},
        trainer_state={"step": step, "rng": ckpt.rng_state()}, config_yaml=f"step: {step}\n", run_id=run_id, **kw).path


def auto(out, warnings=None):
    intact, _ = ckpt.resume_candidates("auto", out, (warnings if warnings is not None else []).append)
    return intact[0] if intact else None


def test_save_load_and_auto_resume(tmp_path):
    assert auto(tmp_path) is None
    assert ckpt.resume_candidates(None, tmp_path, print) == ([], [])
    save(tmp_path, 5, 1.0)
    save(tmp_path, 10, 2.0)
    latest = auto(tmp_path)
    assert latest.name == "step_10"
    state = ckpt.load_checkpoint(latest)
    assert torch.equal(state["model"]["w"], torch.full((3,), 2.0))
    assert state["trainer"]["step"] == 10 and state["meta"]["step"] == 10 and state["meta"]["run_id"] == "run-a"
    assert (latest / "config.yaml").read_text() == "step: 10\n"
    manifest = json.loads((latest / ckpt.MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.pt", "optimizer.pt", "trainer.pt", "config.yaml", "meta.json"}
    assert manifest["files"]["model.pt"]["bytes"] == (latest / "model.pt").stat().st_size


def test_every_file_loads_weights_only(tmp_path):
    """trainer.pt holds RNG states as tensors and plain values: torch.load(weights_only=True) reads all three."""
    path = save(tmp_path, 1, 0.0)
    for name in ckpt.STATE_FILES:
        torch.load(path / name, weights_only=True)
    state = ckpt.load_checkpoint(path)
    ckpt.set_rng_state(state["trainer"]["rng"])
    a = torch.rand(3)
    ckpt.set_rng_state(state["trainer"]["rng"])
    assert torch.equal(torch.rand(3), a)


class _Payload:
    ran = False

    def __reduce__(self):
        return (_mark_ran, ())


def _mark_ran():
    _Payload.ran = True
    return {}


def test_a_pickled_payload_is_refused_not_run(tmp_path):
    """A trainer.pt carrying code (a pickle __reduce__), with a manifest that matches it: refused, never run."""
    path = save(tmp_path, 1, 0.0)
    with open(path / "trainer.pt", "wb") as f:
        torch.save({"step": 1, "evil": _Payload()}, f, pickle_module=pickle)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"]["trainer.pt"] = {"bytes": (path / "trainer.pt").stat().st_size,
                                       "crc32": ckpt.crc32(path / "trainer.pt")}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.DamagedCheckpoint, match="cannot be read safely: .*_mark_ran.*refused"):
        ckpt.load_checkpoint(path)
    assert not _Payload.ran


@pytest.mark.parametrize("damage, reason", [
    ("garbage", "does not match its checksum"),
    ("truncate", "truncated or overwritten"),
    ("no_manifest", "did not finish"),
    ("empty_meta", "meta.json is not valid JSON"),
    ("garbage_meta", "meta.json is not valid JSON"),
])
def test_damage_is_detected_and_auto_falls_back(tmp_path, damage, reason):
    save(tmp_path, 10, 1.0)
    latest = save(tmp_path, 20, 2.0)
    model = latest / "model.pt"
    if damage == "garbage":  # same size, different bytes
        size = model.stat().st_size
        model.write_bytes(bytes(size))
    elif damage == "truncate":
        model.write_bytes(model.read_bytes()[:-100])
    elif damage == "no_manifest":
        (latest / ckpt.MANIFEST).unlink()
    elif damage == "empty_meta":
        (latest / "meta.json").write_text("")
    else:
        (latest / "meta.json").write_text("{not json")
    assert reason in ckpt.verify(latest)
    warnings = []
    assert auto(tmp_path, warnings).name == "step_10"
    assert len(warnings) == 1 and "step_20" in warnings[0] and reason in warnings[0]
    with pytest.raises(UserError, match=f"checkpoint.resume = .*step_20: .*{reason.split()[0]}"):
        ckpt.resume_candidates(str(latest), tmp_path, print)


def test_non_finite_state_is_refused(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, model_state={"w": torch.tensor([1.0, float("nan")])},
                                optimizer_state={"step": 1}, trainer_state={"step": 1}, config_yaml="",
                                run_id="r").path
    with pytest.raises(ckpt.DamagedCheckpoint, match="model.pt holds non-finite values .* in w"):
        ckpt.load_checkpoint(path)
    assert ckpt.first_non_finite({"a": {"b": torch.ones(2), "c": torch.tensor([float("inf")])}}) == "a.c"
    assert ckpt.first_non_finite({"i": torch.tensor([1, 2])}) is None


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    save(tmp_path, 10, 1.0)
    real = ckpt.write_file

    def dying(path, obj=None, text=None):
        if path.name == "optimizer.pt":
            raise KeyboardInterrupt("killed mid-save")
        return real(path, obj, text)

    monkeypatch.setattr(ckpt, "write_file", dying)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 20, 2.0)
    monkeypatch.setattr(ckpt, "write_file", real)
    root = ckpt.checkpoint_root(tmp_path)
    assert not (root / "step_20.partial").exists()  # removed on the way out
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_10"]
    state = ckpt.load_checkpoint(auto(tmp_path))
    assert torch.equal(state["model"]["w"], torch.full((3,), 1.0))


def test_a_leftover_partial_is_ignored_then_cleared(tmp_path):
    save(tmp_path, 10, 1.0)
    leftover = ckpt.checkpoint_root(tmp_path) / "step_20.partial"
    leftover.mkdir()
    (leftover / "model.pt").write_bytes(b"half")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_10"]
    save(tmp_path, 20, 3.0)
    assert not leftover.exists()


def disk_full_at(monkeypatch, name):
    """The checkpoint writer runs out of space when it reaches file ``name``."""
    real = ckpt.write_file

    def full(path, obj=None, text=None):
        if path.name == name:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, obj, text)

    monkeypatch.setattr(ckpt, "write_file", full)


def test_disk_full_mid_save_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    save(tmp_path, 10, 1.0)
    disk_full_at(monkeypatch, "trainer.pt")
    with pytest.raises(UserError) as err:
        save(tmp_path, 20, 2.0)
    message = str(err.value)
    assert "disk full" in message and "needs" in message and "free" in message
    assert "step_10 is intact" in message and "\n" not in message
    assert [p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()] == ["step_10"]


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 10)
    with pytest.raises(UserError, match="not enough disk space: needs about .* 10 B free; no earlier checkpoint"):
        save(tmp_path, 1, 1.0)
    assert list(ckpt.checkpoint_root(tmp_path).iterdir()) == []


def test_keep_last_prunes_only_this_runs_intact_checkpoints(tmp_path):
    save(tmp_path, 1, 1, run_id="other")
    for step in (2, 3, 4, 5):
        save(tmp_path, step, step, run_id="mine", keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_1", "step_4", "step_5"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save(tmp_path, 3, 1.0)
    path = save(tmp_path, 3, 2.0)
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.full((3,), 2.0))
    assert [p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()] == ["step_3"]


def test_format_1_checkpoints_still_load(tmp_path):
    """The old layout (numpy RNG pickled in trainer.pt, no manifest) loads through a numpy-only allowlist."""
    import random

    import numpy as np

    path = ckpt.checkpoint_root(tmp_path) / "step_4"
    path.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, path / "model.pt")
    torch.save({"step": 4}, path / "optimizer.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save({"step": 4, "rng": rng}, path / "trainer.pt")
    (path / "meta.json").write_text(json.dumps({"format_version": 1, "step": 4}))
    assert ckpt.verify(path) is None
    state = ckpt.load_checkpoint(path)
    ckpt.set_rng_state(state["trainer"]["rng"])
    assert state["trainer"]["step"] == 4


def test_explicit_resume_path_must_exist(tmp_path):
    with pytest.raises(UserError, match="no such checkpoint directory"):
        ckpt.resume_candidates(str(tmp_path / "nothing"), tmp_path, print)
    path = save(tmp_path, 3, 0.0)
    assert ckpt.resume_candidates(str(path), "elsewhere", print) == ([path], [])
