"""What `moetrain train` does when the world fails it: full or read-only disks, Ctrl-C twice, CUDA
out-of-memory, configs that will not fit. Each is one line, and the last checkpoint stays intact."""

import errno
import os
import signal

import pytest
import torch

from moetrain import cli
from moetrain.train import checkpoint as ckpt
from moetrain.train import memory_check

from test_checkpoint import disk_full_at
from test_run_dir import SMALL, errors, names, train

GiB = 2**30


def test_read_only_out_dir_is_one_line(tmp_path, capsys, monkeypatch):
    real = type(tmp_path).write_bytes

    def read_only(self, data):
        if ".write-test-" in self.name:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, data)

    monkeypatch.setattr(type(tmp_path), "write_bytes", read_only)
    code, lines = train(capsys, tmp_path / "run", "train.steps=1")
    assert code == 2 and len(lines) == 1 and "read-only file system" in lines[0] and "train.out_dir" in lines[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_out_dir_is_one_line(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, lines = train(capsys, locked / "run", "train.steps=1")
    assert code == 2 and len(lines) == 1 and "permission denied" in lines[0]


def test_disk_full_during_a_save_stops_with_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    train(capsys, out, "train.steps=2")
    disk_full_at(monkeypatch, "optimizer.pt")
    code, lines = train(capsys, out, "train.steps=4", "checkpoint.resume=auto")
    (line,) = errors(lines)
    assert code == 2 and "disk full" in line and "needs" in line and "step_2 is intact" in line
    assert names(out) == ["step_2"] and not list((out / "checkpoints").glob("*.partial"))
    assert "Traceback" not in "\n".join(lines)


def test_a_second_ctrl_c_during_the_save_stops_with_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C asks for a save at the end of the step; a second one during that save stops at once. The
    real signal handler runs (signals raised in this process): the partial save is removed, the previous
    checkpoint stays."""
    out = tmp_path / "run"
    train(capsys, out, "train.steps=2")
    real = ckpt.write_file
    calls = []

    def interrupted(path, obj=None, text=None):
        calls.append(path.name)
        if path.name in ("model.pt", "optimizer.pt"):  # first Ctrl-C, then the second mid-save
            signal.raise_signal(signal.SIGINT)
        return real(path, obj, text)

    monkeypatch.setattr(ckpt, "write_file", interrupted)
    code = cli.main(["train", f"train.out_dir={out}", *SMALL, "train.steps=6", "checkpoint.interval=3",
                     "checkpoint.resume=auto"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(errors(lines)) == 1
    assert "interrupted: during the save of checkpoint step_3, which was not written" in errors(lines)[0]
    assert "step_2 is intact" in errors(lines)[0]
    assert names(out) == ["step_2"] and not list((out / "checkpoints").glob("*.partial"))
    assert calls == ["model.pt", "optimizer.pt"]


def test_cuda_out_of_memory_is_one_line_with_the_projection(tmp_path, capsys, monkeypatch):
    from moetrain.train.trainer import Trainer

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                          "capacity of 139.81 GiB of which 1.2 GiB is free.")

    monkeypatch.setattr(Trainer, "forward_backward_step", oom)
    code, lines = train(capsys, tmp_path / "run", "train.steps=2")
    (line,) = errors(lines)
    assert code == 2 and "CUDA out of memory at step 1 (CUDA out of memory. Tried to allocate 2.00 GiB)" in line
    assert "projected peak memory" in line and "train.micro_batch_size" in line


@pytest.fixture
def host_with(monkeypatch):
    def set_available(gib):
        monkeypatch.setattr(memory_check, "host_available_bytes", lambda: gib * GiB)
    return set_available


def test_the_readme_qwen3_command_is_refused_in_seconds_on_a_24_gib_host(tmp_path, capsys, host_with, monkeypatch):
    host_with(22.5)  # what a 24 GiB machine has available
    import moetrain.models as models

    monkeypatch.setattr(models, "build_model", lambda cfg: pytest.fail("allocated before refusing"))
    code = cli.main(["train", "--preset", "qwen3-30b-a3b", "model.num_layers=2", "train.steps=10",
                     f"train.out_dir={tmp_path / 'q'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "projected peak memory 37." in lines[0] and "of 22.50 GiB available in CPU RAM" in lines[0]
    assert "will not fit" in lines[0] and "train.skip_memory_check=true" in lines[0]
    assert "changes projected to fit" in lines[0] and "model.num_layers=1" in lines[0]


def test_suggestions_are_projected_to_fit(host_with):
    from moetrain.config.load import load_config

    cfg = load_config(preset="qwen3-30b-a3b", overrides=["model.num_layers=4", "train.seq_length=1024",
                                                          "train.micro_batch_size=4", "train.global_batch_size=8"])
    cpu = torch.device("cpu")
    full = memory_check.project(cfg, cpu).peak_gib
    available = 0.8 * full * GiB
    fixes, smallest = memory_check.suggestions(cfg, cpu, available)
    assert fixes and smallest is None and len(fixes) <= memory_check.MAX_SUGGESTIONS
    for fix in fixes:
        changes = dict(part.split("=") for part in fix.split(" (")[0].split())
        peak = float(fix.split(" (")[1].split()[0])
        assert peak < 0.8 * full
        assert set(changes) <= {"optim.exp_avg_dtype", "optim.exp_avg_sq_dtype", "optim.main_grads_dtype",
                                "precision.master_weights", "train.recompute", "train.micro_batch_size",
                                "model.num_layers"}


def test_at_risk_warns_and_skip_memory_check_trains_anyway(tmp_path, capsys, host_with):
    cfg_peak = None
    from moetrain.config.load import load_config

    cfg = load_config(overrides=[f"train.out_dir={tmp_path}", *SMALL])
    cfg_peak = memory_check.project(cfg, torch.device("cpu")).reserved_gib
    host_with(cfg_peak / 0.95)  # 95% of what is available: at risk
    code, lines = train(capsys, tmp_path / "a", "train.steps=1")
    assert code == 0 and any("at risk of running out of memory" in line for line in lines)
    host_with(cfg_peak / 2)
    code, lines = train(capsys, tmp_path / "b", "train.steps=1")
    assert code == 2 and "will not fit" in errors(lines)[0]
    code, lines = train(capsys, tmp_path / "c", "train.steps=1", "train.skip_memory_check=true")
    assert code == 0 and any("trying anyway" in line for line in lines)


def test_plain_output_has_no_markup_and_reports_saves_and_eval(tmp_path, capsys, monkeypatch):
    import moetrain.models as models

    real_build = models.build_model

    def build(cfg):  # the second micro-batch's loss is NaN: a skipped step, logged in yellow on a terminal
        model = real_build(cfg)
        forward, calls = model.forward, []

        def poisoned(input_ids, labels=None):
            out = forward(input_ids, labels)
            calls.append(1)
            if len(calls) == 2:
                out.loss = out.loss * float("nan")
            return out

        model.forward = poisoned
        return model

    monkeypatch.setattr(models, "build_model", build)
    code, lines = train(capsys, tmp_path / "run", "train.steps=4", "checkpoint.interval=2",
                        "train.eval_interval=2", "train.eval_steps=1")
    text = "\n".join(lines)
    assert code == 0 and "[yellow]" not in text and "step 2: non-finite loss" in text
    assert sum(line.startswith("saved checkpoint") and "MiB" in line for line in lines) == 2
    assert sum("eval loss" in line for line in lines) == 2


def test_deepseek_v3_at_fp32_master_weights_is_refused_on_an_h200(monkeypatch):
    """Two layers of DeepSeek-V3 (one dense, one MoE) with the default fp32 master weights do not fit an H200;
    the refusal names the bf16 optimizer state that does, and that change is projected to fit."""
    from moetrain.config.load import load_config

    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (138.9 * GiB, "on NVIDIA H200 GPU memory"))
    overrides = ["model.num_layers=2", "moe.first_k_dense=1", "model.mtp_num_layers=0", "train.global_batch_size=1"]
    cfg = load_config(preset="deepseek-v3", overrides=overrides)
    with pytest.raises(memory_check.UserError) as err:
        memory_check.check(cfg, torch.device("cuda"), print)
    message = str(err.value)
    assert "will not fit" in message and "of 138.90 GiB available on NVIDIA H200 GPU memory" in message
    assert ("optim.exp_avg_dtype=bf16 optim.exp_avg_sq_dtype=bf16 optim.main_grads_dtype=bf16 "
            "precision.master_weights=false (") in message
    fixed = load_config(preset="deepseek-v3", overrides=overrides + [
        "optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16", "optim.main_grads_dtype=bf16",
        "precision.master_weights=false"])
    assert memory_check.check(fixed, torch.device("cuda"), print).verdict in ("fits", "at-risk")
