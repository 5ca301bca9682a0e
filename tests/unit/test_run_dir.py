"""An out_dir belongs to one run lineage: fresh runs never overwrite or mix with another run, resumes
refuse what does not fit, damaged checkpoints are skipped or named, and nothing is deleted unasked."""

import json
from pathlib import Path

import pytest
import torch

from moetrain import cli
from moetrain.train import checkpoint as ckpt
from moetrain.train import run_dir

SMALL = ["train.micro_batch_size=2", "train.global_batch_size=2", "train.seq_length=16", "optim.warmup_steps=1",
         "train.log_interval=100"]


def train(capsys, out, *overrides):
    """`moetrain train` in this process: (exit code, stderr lines)."""
    code = cli.main(["train", f"train.out_dir={out}", *SMALL, *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def errors(lines):
    return [line for line in lines if line.startswith("error:")]


def steps_in_metrics(out):
    return [json.loads(line)["step"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def names(out):
    return [p.name for p in ckpt.list_checkpoints(out)]


def test_a_fresh_run_into_a_used_out_dir_is_refused_and_nothing_changes(tmp_path, capsys):
    out = tmp_path / "keep"
    assert train(capsys, out, "train.steps=8", "checkpoint.interval=2")[0] == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, lines = train(capsys, out, "train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=2")
    assert code == 2 and len(errors(lines)) == 1 and len(lines) == 1
    assert "already holds a run" in lines[0] and "checkpoint.resume=auto" in lines[0]
    assert "train.overwrite=true" in lines[0] and "4 checkpoint(s), the last step_8" in lines[0]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    # continuing it is one key away
    code, lines = train(capsys, out, "train.steps=10", "checkpoint.interval=2", "checkpoint.resume=auto")
    assert code == 0 and steps_in_metrics(out) == list(range(1, 11))


def test_overwrite_moves_the_old_run_aside_and_keep_last_prunes_only_the_new_one(tmp_path, capsys):
    out = tmp_path / "keep"
    train(capsys, out, "train.steps=8", "checkpoint.interval=2")
    old_id = run_dir.read_run_id(out)
    code, lines = train(capsys, out, "train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=1",
                        "train.overwrite=true")
    assert code == 0 and any("moved the earlier run" in line for line in lines)
    assert names(out) == ["step_4"] and steps_in_metrics(out) == [1, 2, 3, 4]
    assert run_dir.read_run_id(out) != old_id
    (aside,) = (out / run_dir.REPLACED_DIR).iterdir()
    assert names(aside) == ["step_2", "step_4", "step_6", "step_8"]
    assert len((aside / "metrics.jsonl").read_text().splitlines()) == 8
    assert run_dir.read_run_id(aside) == old_id


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path, capsys):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=6", "checkpoint.interval=2")
    code, lines = train(capsys, out, "train.steps=5", f"checkpoint.resume={out}/checkpoints/step_2")
    assert code == 0 and any("later checkpoint(s) (step_4, step_6)" in line for line in lines)
    assert names(out) == ["step_2", "step_5"] and steps_in_metrics(out) == [1, 2, 3, 4, 5]
    (aside,) = (out / run_dir.REPLACED_DIR).iterdir()
    assert names(aside) == ["step_4", "step_6"] and len((aside / "metrics.jsonl").read_text().splitlines()) == 6


def test_a_finished_run_says_so_and_exits_0(tmp_path, capsys):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=3")
    code, lines = train(capsys, out, "train.steps=3", "checkpoint.resume=auto")
    assert code == 0 and any("nothing to train" in line and "step 3" in line for line in lines)
    code, lines = train(capsys, out, "train.steps=2", "checkpoint.resume=auto")
    assert code == 0 and any("the run is finished" in line for line in lines)
    assert steps_in_metrics(out) == [1, 2, 3]


def test_resuming_another_runs_checkpoint_into_a_used_out_dir_is_refused(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    train(capsys, a, "train.steps=2")
    train(capsys, b, "train.steps=2")
    code, lines = train(capsys, b, "train.steps=4", f"checkpoint.resume={a}/checkpoints/step_2")
    assert code == 2 and len(lines) == 1 and "would mix the two" in lines[0]
    # into a new out_dir it continues run a's lineage there, and a's own files are untouched
    c = tmp_path / "c"
    code, _ = train(capsys, c, "train.steps=4", f"checkpoint.resume={a}/checkpoints/step_2", "checkpoint.interval=1",
                    "checkpoint.keep_last=1")
    assert code == 0 and run_dir.read_run_id(c) == run_dir.read_run_id(a)
    assert names(c) == ["step_4"] and names(a) == ["step_2"]


def _corrupt_same_size(path: Path) -> None:
    size = path.stat().st_size
    path.write_bytes(b"\x07" * size)


def test_a_corrupted_latest_checkpoint_is_skipped_with_a_warning(tmp_path, capsys):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=4", "checkpoint.interval=2")
    _corrupt_same_size(out / "checkpoints" / "step_4" / "model.pt")
    code, lines = train(capsys, out, "train.steps=6", "checkpoint.resume=auto")
    assert code == 0
    assert any("skipping damaged checkpoint" in line and "step_4" in line and "checksum" in line for line in lines)
    assert any("resumed from" in line and "step_2" in line for line in lines)
    assert steps_in_metrics(out) == list(range(1, 7))
    # an explicit damaged path is one line
    _corrupt_same_size(out / "checkpoints" / "step_6" / "optimizer.pt")
    code, lines = train(capsys, out, "train.steps=8", f"checkpoint.resume={out}/checkpoints/step_6")
    assert code == 2 and len(lines) == 1 and "optimizer.pt does not match its checksum" in lines[0]


def test_a_truncated_latest_checkpoint_falls_back(tmp_path, capsys):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=4", "checkpoint.interval=2")
    model = out / "checkpoints" / "step_4" / "model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    (out / "checkpoints" / "step_2" / "meta.json").write_text("")  # and the one before has empty meta.json
    code, lines = train(capsys, out, "train.steps=5", "checkpoint.resume=auto")
    assert code == 0 and sum("skipping damaged checkpoint" in line for line in lines) == 2
    assert any("no intact checkpoint" in line and "starting fresh" in line for line in lines)
    assert steps_in_metrics(out) == [1, 2, 3, 4, 5]


def _rewrite_with_manifest(path: Path, name: str, state) -> None:
    torch.save(state, path / name)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"][name] = {"bytes": (path / name).stat().st_size, "crc32": ckpt.crc32(path / name)}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_non_finite_weights_in_a_checkpoint_are_refused(tmp_path, capsys):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=4", "checkpoint.interval=2")
    latest = out / "checkpoints" / "step_4"
    state = torch.load(latest / "model.pt", weights_only=True)
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name] * float("nan")
    _rewrite_with_manifest(latest, "model.pt", state)
    code, lines = train(capsys, out, "train.steps=8", f"checkpoint.resume={latest}")
    assert code == 2 and len(lines) == 1 and f"non-finite values (NaN or inf) in {name}" in lines[0]
    code, lines = train(capsys, out, "train.steps=5", "checkpoint.resume=auto")
    assert code == 0 and any("skipping damaged checkpoint" in line and "non-finite" in line for line in lines)
    assert any("resumed from" in line and "step_2" in line for line in lines)


def test_a_resume_with_another_model_size_names_the_first_parameter(tmp_path, capsys):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=2")
    code, lines = train(capsys, out, "train.steps=4", "checkpoint.resume=auto", "model.hidden_size=32")
    assert code == 2 and len(lines) == 1
    assert "does not fit this model: embed.weight is [512, 64] there and [512, 32] here" in lines[0]
    assert "model.hidden_size: 64 there, 32 here" in lines[0]


def test_nan_weights_are_never_saved_as_the_latest_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=2")
    from moetrain.train import optim

    real_step = optim.PrecisionAwareAdamW.count_step

    def poisoned(self):  # the update leaves a NaN in the weights (steps themselves look finite)
        real_step(self)
        with torch.no_grad():
            self.slots[0].param.view(-1)[0] = float("nan")

    monkeypatch.setattr(optim.PrecisionAwareAdamW, "count_step", poisoned)
    code, lines = train(capsys, out, "train.steps=4", "checkpoint.resume=auto")
    assert code == 2 and len(errors(lines)) == 1
    assert "non-finite values" in errors(lines)[0] and "not saved" in errors(lines)[0]
    assert "step_2 is intact" in errors(lines)[0]
    assert names(out) == ["step_2"]


@pytest.mark.parametrize("bad", ["file", "nested"])
def test_an_out_dir_that_is_not_a_directory_is_one_line(tmp_path, capsys, bad):
    target = tmp_path / "taken"
    target.write_text("a file")
    out = target if bad == "file" else target / "run"
    code, lines = train(capsys, out, "train.steps=1")
    assert code == 2 and len(lines) == 1 and f"train.out_dir = {out}" in lines[0]
    assert "not a directory" in lines[0] or "is a file" in lines[0]


def test_export_takes_the_newest_intact_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=4", "checkpoint.interval=2")
    _corrupt_same_size(out / "checkpoints" / "step_4" / "model.pt")
    assert cli.main(["convert", "moetrain-to-hf", "--ckpt", str(out), "--out", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint" in err and "step_4" in err
    assert (tmp_path / "hf" / "config.json").is_file()
    _corrupt_same_size(out / "checkpoints" / "step_2" / "model.pt")
    code = cli.main(["convert", "moetrain-to-hf", "--ckpt", str(out), "--out", str(tmp_path / "hf2")])
    assert code == 2 and "none of its 2 checkpoint(s) is intact" in capsys.readouterr().err
    assert not (tmp_path / "hf2").exists()
