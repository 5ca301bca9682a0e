"""`moetrain plan` commands: wiring, JSON contract, no torch import, speed, one-line errors."""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetrain import cli
from moetrain.plan.cli import main, register

REPO = Path(__file__).resolve().parents[2]

# A sensible layout per preset (what a user would try first).
LAYOUTS = {
    "tiny": [],
    "deepseek-v2-lite": ["parallel.ep=8", "parallel.dp=8", "train.global_batch_size=512"],
    "deepseek-v2": ["parallel.pp=4", "parallel.vpp=5", "parallel.pp_schedule=interleaved", "parallel.ep=8",
                    "parallel.dp=8"],
    "deepseek-v3": ["parallel.pp=16", "parallel.vpp=2", "parallel.pp_schedule=interleaved", "parallel.ep=8",
                    "parallel.dp=8", "train.recompute=selective", "parallel.pipeline_layout=Et|(tt|)*29t|tmL"],
    "gpt-oss-120b": ["parallel.ep=8", "parallel.dp=8", "parallel.pp=4"],
    "gpt-oss-20b": ["parallel.ep=8", "parallel.dp=8"],
    "llama3-8b": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=4", "train.global_batch_size=512"],
    "mixtral-8x22b": ["parallel.pp=8", "parallel.ep=8", "parallel.dp=8", "parallel.pipeline_layout=Et*6|(t*7|)*6t*8L"],
    "mixtral-8x7b": ["parallel.pp=4", "parallel.ep=8", "parallel.dp=8", "parallel.vpp=2",
                     "parallel.pp_schedule=interleaved"],
    "moe-1t": ["parallel.pp=24", "parallel.ep=8", "parallel.dp=8", "parallel.cp=2", "train.recompute=selective"],
    "moe-2t": ["parallel.pp=24", "parallel.ep=16", "parallel.dp=16", "parallel.cp=2", "train.recompute=selective"],
    "qwen3-235b-a22b": ["parallel.pp=8", "parallel.ep=8", "parallel.dp=8", "parallel.pipeline_layout=Et*11|(t*12|)*6t*11L"],
    "qwen3-30b-a3b": ["parallel.ep=8", "parallel.dp=8"],
}


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_preset_is_covered():
    from moetrain.config.load import list_presets

    assert sorted(LAYOUTS) == sorted(list_presets())


@pytest.mark.parametrize("preset", sorted(LAYOUTS))
def test_memory_and_perf_json_for_every_preset_fast(preset, capsys):
    for cmd, keys in (("memory", {"peak_gib", "verdict", "per_rank"}),
                      ("perf", {"step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "bubble_fraction",
                                "per_rank"})):
        started = time.perf_counter()
        rc, out, err = run_cli(capsys, cmd, "--preset", preset, *LAYOUTS[preset], "--json")
        # a gross bound only (a projection is ~0.1 s; a shared CI core can be 10x slower): catches a search that
        # went combinatorial, not a slow machine
        assert time.perf_counter() - started < 10.0, f"{cmd} {preset} took too long"
        assert (rc, err) == (0, "")
        data = json.loads(out)
        assert keys <= set(data)
        assert data["per_rank"] and all(r["pp_rank"] == i for i, r in enumerate(data["per_rank"]))
        if cmd == "memory":
            assert data["verdict"] in ("fits", "at-risk", "out-of-memory")
            for r in data["per_rank"]:
                parts = sum(r[k] for k in ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "other_gib"))
                assert parts == pytest.approx(r["total_gib"], abs=1e-3)
        else:
            assert data["step_time_s"] > 0 and 0 < data["mfu"] < 1


def test_no_torch_import_without_a_pipeline_and_real_entry_point(tmp_path):
    """Without pipelining nothing imports torch (a pipeline's schedule order comes from torch's classes)."""
    code = ("import sys; from moetrain.plan.cli import main;"
            "main(['memory', '--preset', 'deepseek-v3', 'parallel.ep=8', 'parallel.dp=8']);"
            "main(['perf', '--preset', 'qwen3-30b-a3b', '--hardware', 'mi300x']);"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "verdict" in p.stdout and "MFU" in p.stdout


@pytest.mark.parametrize("argv, match", [
    (["memory", "--preset", "tiny", "--hardware", "v100"], "unknown hardware 'v100'; built-in: a100-80gb-sxm"),
    (["memory", "--preset", "tiny", "parallel.pp=2", "train.micro_batch_size=4",
      "parallel.pipeline_layout=Et*2|t*3mL"],
     "parallel.pipeline_layout = 'Et*2|t*3mL' places 5 decoder layers"),
    (["perf", "--preset", "tiny", "--moe-imbalance", "0.5"], "--moe-imbalance"),
])
def test_user_errors_are_one_line(argv, match, capsys):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_register_wires_into_the_main_parser(capsys):
    parser = argparse.ArgumentParser(prog="moetrain")
    commands = parser.add_subparsers(dest="command", required=True)
    register(commands, cli._add_config_source)
    args = cli._parse(parser, ["plan", "memory", "--preset", "tiny", "train.seq_length=128", "--json"])
    assert args.subcommand == "memory" and args.overrides == ["train.seq_length=128"]
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["per_rank"][0]["pp_rank"] == 0


def test_timeline_file(tmp_path, capsys):
    out = tmp_path / "timeline.json"
    rc, _, err = run_cli(capsys, "perf", "--preset", "llama3-8b", "parallel.pp=4", "train.global_batch_size=8",
                         "--timeline", str(out))
    assert (rc, err) == (0, "")
    tl = json.loads(out.read_text())
    assert tl["pp"] == 4 and len(tl["ranks"]) == 4
    ops = tl["ranks"][0]["ops"]
    assert sorted((o["kind"], o["micro_batch"]) for o in ops) == sorted(
        [("F", i) for i in range(8)] + [("B", i) for i in range(8)])
    assert all(o["end"] > o["start"] for o in ops)


def test_validate_refuses_without_gpu(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rc, out, err = run_cli(capsys, "validate", "--configs", "tiny-wide")
    assert rc == 2 and "needs" not in out and err.startswith("error: plan validate runs the real trainer")
