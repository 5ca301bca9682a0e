"""The `moetrain` command line: round trips, wiring to library functions, one-line user errors."""

import dataclasses
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from moetrain import __version__, cli
from moetrain.config import load_config
from moetrain.config.schema import SECTIONS
from moetrain.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[2]


def moetrain(*args, cwd):
    """Run `python -m moetrain ARGS` in a subprocess; returns (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "moetrain", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    return p.returncode, p.stdout, p.stderr


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ---- subprocess: the real entry point --------------------------------------------------------

def test_config_show_round_trips(tmp_path):
    write(tmp_path / "run.yaml", """
        extends: tiny
        model: {num_layers: 3}
        train: {recompute_layer_ids: [0, 2]}
    """)
    rc, out, err = moetrain("config", "show", "--config", "run.yaml", "moe.topk=3", "optim.lr=1e-3", cwd=tmp_path)
    assert (rc, err) == (0, "")
    write(tmp_path / "shown.yaml", out)
    expected = load_config(str(tmp_path / "run.yaml"), overrides=["moe.topk=3", "optim.lr=1e-3"])
    assert load_config(str(tmp_path / "shown.yaml")) == expected
    assert (expected.model.num_layers, expected.moe.topk, expected.optim.lr) == (3, 3, 1e-3)
    assert expected.train.recompute_layer_ids == [0, 2]


def test_config_show_preset_and_overrides_after_options(tmp_path):
    rc, out, err = moetrain("config", "show", "train.steps=5", "--preset", "tiny", "train.seed=9", cwd=tmp_path)
    assert (rc, err) == (0, "")
    write(tmp_path / "shown.yaml", out)
    cfg = load_config(str(tmp_path / "shown.yaml"))
    assert cfg == load_config(preset="tiny", overrides=["train.steps=5", "train.seed=9"])


def test_config_show_doc_lists_every_field(tmp_path):
    rc, out, err = moetrain("config", "show", "--doc", cwd=tmp_path)
    assert (rc, err) == (0, "")
    listed = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  ") and
              not line.startswith("      ")]
    assert listed == [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert "  model.hidden_size: int (>= 1) = 64\n      Model width H.\n" in out


@pytest.mark.parametrize("args,files,message", [
    (["config", "show", "--config", "f.yaml"], {"f.yaml": "model: {hidden_sizee: 3}\n"},
     "error: unknown key model.hidden_sizee (from f.yaml); did you mean model.hidden_size?"),
    (["config", "show", "moe.topk=two"], {},
     "error: moe.topk: expected int; got 'two' (from command line)"),
    (["config", "show", "--config", "missing.yaml"], {}, "error: config file not found: missing.yaml"),
    (["config", "show", "--config", "bad.yaml"], {"bad.yaml": "model:\n  a: 1\n    b: 2\n"},
     "error: invalid YAML in bad.yaml at line 3, column 6: mapping values are not allowed here"),
    (["model", "info", "--preset", "nope"], {},
     "error: unknown preset 'nope' (available: " + ", ".join(
         sorted(p.stem for p in (REPO / "moetrain/config/presets").glob("*.yaml"))) + ")"),
    (["train", "moe.topk=9"], {},
     ("error: moe.topk = 9 must be between 1 and moe.num_experts = 8 "
      "(moe.topk from command line, moe.num_experts from preset tiny)")),
    (["config", "show", "topk"], {}, "error: override 'topk': expected section.key=value (e.g. moe.topk=2)"),
])
def test_user_errors_exit_2_with_one_line(tmp_path, args, files, message):
    for name, text in files.items():
        write(tmp_path / name, text)
    rc, out, err = moetrain(*args, cwd=tmp_path)
    assert (rc, out, err) == (2, "", message + "\n")


def test_usage_errors_exit_2_without_traceback(tmp_path):
    rc, out, err = moetrain("model", "info", cwd=tmp_path)
    assert rc == 2 and out == ""
    assert err.splitlines()[-1] == "moetrain model info: error: one of the arguments --config --preset is required"
    rc, out, err = moetrain("config", "show", "--bogus", cwd=tmp_path)
    assert rc == 2 and err.splitlines()[-1] == "moetrain: error: unrecognized arguments: --bogus"
    rc, out, err = moetrain("config", "show", "--config", "a.yaml", "--preset", "tiny", cwd=tmp_path)
    assert rc == 2 and err.splitlines()[-1] == (
        "moetrain config show: error: argument --preset: not allowed with argument --config")
    rc, out, err = moetrain("frobnicate", cwd=tmp_path)  # not a command
    assert rc == 2 and "invalid choice: 'frobnicate'" in err and "Traceback" not in err


def test_version(tmp_path):
    assert moetrain("--version", cwd=tmp_path) == (0, f"moetrain {__version__}\n", "")


def test_config_show_and_model_info_do_not_import_torch(tmp_path):
    code = textwrap.dedent("""
        import contextlib, io, sys
        from moetrain.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["config", "show", "--preset", "tiny"]) == 0
            assert main(["config", "show", "--doc"]) == 0
            assert main(["model", "info", "--preset", "deepseek-v3", "--json"]) == 0
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert (p.returncode, p.stdout, p.stderr) == (0, "[]\n", "")


# ---- in process: wiring to library functions (fakes stand in for the real work) ---------------

@pytest.fixture
def fake_module(monkeypatch):
    def install(name, **attrs):
        module = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(module, k, v)
        monkeypatch.setitem(sys.modules, name, module)
        return module
    return install


def test_train_loads_config_and_calls_run(fake_module):
    seen = []
    fake_module("moetrain.train.trainer", run=lambda cfg: seen.append(cfg))
    assert cli.main(["train", "train.steps=3", "model.num_layers=2"]) == 0
    assert seen == [load_config(preset="tiny", overrides=["train.steps=3", "model.num_layers=2"])]
    seen.clear()
    assert cli.main(["train", "--preset", "qwen3-30b-a3b", "train.steps=1"]) == 0
    assert seen == [load_config(preset="qwen3-30b-a3b", overrides=["train.steps=1"])]


def test_model_info_passes_json_flag(fake_module, capsys):
    calls = []

    def report(cfg, as_json):
        calls.append((cfg.model.name, cfg.model.num_layers, as_json))
        return f"report {cfg.model.name}"

    fake_module("moetrain.model_info", model_info_report=report)
    assert cli.main(["model", "info", "--preset", "tiny", "--json", "model.num_layers=3"]) == 0
    assert cli.main(["model", "info", "--preset", "deepseek-v3"]) == 0
    assert calls == [("tiny", 3, True), ("deepseek-v3", load_config(preset="deepseek-v3").model.num_layers, False)]
    assert capsys.readouterr().out == "report tiny\nreport deepseek-v3\n"


def test_data_prepare_passes_inputs_tokenizer_output(fake_module, capsys):
    calls = []

    def prepare(inputs, tokenizer, output):
        calls.append((inputs, tokenizer, output))
        return {"num_tokens": 123, "num_docs": 4, "output": output, "seconds": 0.5}

    fake_module("moetrain.train.tokenize", prepare=prepare)
    assert cli.main(["data", "prepare", "--input", "a.txt", "b.jsonl", "--tokenizer", "bytes",
                     "--output", "out/ds"]) == 0
    assert calls == [(["a.txt", "b.jsonl"], "bytes", "out/ds")]
    assert capsys.readouterr().out == "wrote 123 tokens in 4 documents to out/ds (0.5 s)\n"


def _raising(exc):
    def run(cfg):
        raise exc
    return run


@pytest.mark.parametrize("exc,code,line", [
    (UserError("data.path 'x': not a dataset\n(run moetrain data prepare)"), 2,
     "error: data.path 'x': not a dataset (run moetrain data prepare)"),
    (ConfigError("moe.topk = 3 bad"), 2, "error: moe.topk = 3 bad"),
    (FileNotFoundError(2, "No such file or directory", "data/train.bin"), 2,
     "error: no such file or directory: data/train.bin"),
    (OSError(28, "No space left on device", "runs/x/metrics.jsonl"), 2, "error: disk full: runs/x/metrics.jsonl"),
    (OSError(30, "Read-only file system", "runs/x"), 2, "error: read-only file system: runs/x"),
    (KeyboardInterrupt("during the save of checkpoint step_3, which was not written"), 130,
     "error: interrupted: during the save of checkpoint step_3, which was not written"),
    (KeyboardInterrupt(), 130, "error: interrupted"),
])
def test_errors_from_commands(fake_module, capsys, exc, code, line):
    fake_module("moetrain.train.trainer", run=_raising(exc))
    assert cli.main(["train"]) == code
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", line + "\n")


def test_bugs_keep_their_traceback(fake_module):
    fake_module("moetrain.train.trainer", run=_raising(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["train"])
    fake_module("moetrain.train.trainer", run=_raising(FileNotFoundError("no filename: a bug")))
    with pytest.raises(FileNotFoundError):
        cli.main(["train"])


def test_bench_commands_refuse_without_gpu_in_one_line():
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        return  # on a GPU machine the benchmarks run; this checks the CPU refusal only
    for which in ("moe", "train"):
        proc = subprocess.run([sys.executable, "-m", "moetrain", "bench", which], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2
        assert proc.stderr.strip() == f"error: moetrain bench {which} needs a CUDA GPU (none is visible)"


def test_triton_backend_without_a_gpu_is_one_line_error(tmp_path, monkeypatch):
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "moetrain", "train", "moe.backend=triton", "train.steps=1",
                           f"train.out_dir={tmp_path}", "train.device=cpu"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "backend 'triton' (our MoE kernels) needs" in proc.stderr.strip().splitlines()[-1]
