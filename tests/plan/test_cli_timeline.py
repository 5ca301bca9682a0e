"""`moetrain plan timeline`: simulated and measured sources, PNG and HTML figures, JSON, one-line errors."""

import json
import re
import sys

import pytest

from moetrain.plan.cli import main
from moetrain.plan.timeline import RankTimelineWriter

PRESET = ["preset:llama3-8b", "parallel.pp=4", "train.global_batch_size=8"]  # 1F1B, 4 ranks, 8 micro-batches


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def run_dir(tmp_path):
    """A measured 1F1B step of 2 ranks and 2 micro-batches (step 7), as the trainer writes it."""
    meta = {"schedule": "1f1b", "pp": 2, "vpp": 1, "micro_batches": 2}
    ops = {0: [("F", 0, 0.0, 0.01), ("F", 1, 0.01, 0.02), ("B", 0, 0.045, 0.065), ("B", 1, 0.075, 0.095)],
           1: [("F", 0, 0.012, 0.022), ("B", 0, 0.022, 0.042), ("F", 1, 0.042, 0.052), ("B", 1, 0.052, 0.072)]}
    d = tmp_path / "run"
    for r in (0, 1):
        w = RankTimelineWriter(d, r, meta)
        w.add_step(7, [{"kind": k, "micro_batch": mb, "stage": r, "chunk": 0, "start": a, "end": b}
                       for k, mb, a, b in ops[r]], 20.5 + r)
    return d


def rects(page: str, cls: str) -> int:
    return len(re.findall(f'<rect class="{cls}', page))


def test_png_from_a_preset(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sim.png"
    rc, stdout, err = run_cli(capsys, "timeline", *PRESET, "--out", str(out))
    assert (rc, stdout, err) == (0, "", "")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_png_measured_and_simulated_stacked(tmp_path, run_dir, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "both.png"
    rc, _, err = run_cli(capsys, "timeline", str(run_dir), *PRESET, "--out", str(out))
    assert (rc, err) == (0, "")
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 20_000


def test_html_from_a_run_dir(tmp_path, run_dir, capsys):
    out = tmp_path / "run.html"
    rc, _, err = run_cli(capsys, "timeline", str(run_dir), "--out", str(out))
    assert (rc, err) == (0, "")
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 1
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert rects(page, "op ") == 8
    assert rects(page, "op F") == 4 and rects(page, "op B") == 4
    # idle: rank 0 [0.02, 0.045] and [0.065, 0.075]; rank 1 [0, 0.012] and [0.072, 0.095] (the step ends at 0.095)
    assert rects(page, "bubble") == 4
    assert "measured" in page and "(step 7)" in page and "1f1b, pp=2 vpp=1, 2 micro-batches, step 95 ms" in page
    assert "idle 36.8%, peak 20.5 GiB" in page  # rank 0: busy 60 of 95 ms
    assert "idle 36.8%, peak 21.5 GiB" in page  # rank 1: busy 60 of 95 ms too


def test_html_and_json_from_a_preset_and_a_run(tmp_path, run_dir, capsys):
    out = tmp_path / "both.html"
    rc, stdout, err = run_cli(capsys, "timeline", *PRESET, str(run_dir), "--out", str(out), "--json")
    assert (rc, err) == (0, "")
    data = json.loads(stdout)
    assert list(data) == ["timelines"]
    sim, meas = data["timelines"]
    assert set(sim) == {"source", "label", "step", "schedule", "pp", "vpp", "micro_batches", "step_time_s", "ranks"}
    assert set(sim["ranks"][0]) == {"rank", "busy_s", "bubble_fraction", "peak_mem_gib", "ops"}
    assert (sim["source"], sim["label"], sim["schedule"], sim["pp"], sim["micro_batches"]) == (
        "simulated", "preset:llama3-8b", "1f1b", 4, 8)
    assert all(r["peak_mem_gib"] > 1 for r in sim["ranks"])  # the planner's memory projection per rank
    assert sorted((o["kind"], o["micro_batch"]) for o in sim["ranks"][2]["ops"]) == sorted(
        [("F", i) for i in range(8)] + [("B", i) for i in range(8)])
    assert (meas["source"], meas["step"], meas["pp"]) == ("measured", 7, 2)
    page = out.read_text()
    assert rects(page, "op ") == 4 * 16 + 8
    idle = 0
    for tl in (sim, meas):  # gaps inside [0, step] (over 1e-9 of it): between ops, before the first, after the last
        eps = 1e-9 * tl["step_time_s"]
        for r in tl["ranks"]:
            t = 0.0
            for o in sorted(r["ops"], key=lambda o: o["start"]):
                idle += o["start"] > t + eps
                t = max(t, o["end"])
            idle += tl["step_time_s"] > t + eps
    assert rects(page, "bubble") == idle
    assert page.count('class="title"') == 2


def test_step_selects_a_recorded_step(run_dir, capsys):
    rc, stdout, _ = run_cli(capsys, "timeline", str(run_dir), "--json", "--step", "7")
    assert rc == 0 and json.loads(stdout)["timelines"][0]["step"] == 7
    rc, _, err = run_cli(capsys, "timeline", str(run_dir), "--json", "--step", "3")
    assert rc == 2 and "step 3 was not recorded by every rank; steps recorded by all: [7]" in err


def test_config_file_source_with_preset_flag(tmp_path, capsys):
    cfg = tmp_path / "pp.yaml"
    cfg.write_text("extends: llama3-8b\nparallel:\n  pp: 2\n  vpp: 2\n  pp_schedule: zero_bubble\n"
                   "train:\n  global_batch_size: 8\n")
    rc, stdout, err = run_cli(capsys, "timeline", str(cfg), "--preset", "tiny", "--json")
    assert (rc, err) == (0, ""), err
    zb, tiny = json.loads(stdout)["timelines"]
    assert (zb["label"], zb["schedule"], zb["pp"], zb["vpp"]) == (str(cfg), "zero_bubble", 2, 2)
    assert {o["kind"] for r in zb["ranks"] for o in r["ops"]} == {"F", "B", "W"}
    assert (tiny["label"], tiny["pp"]) == ("preset:tiny", 1)


@pytest.mark.parametrize("argv, match", [
    (["timeline", "nowhere.yaml", "--out", "x.png"], "nowhere.yaml: no such file or directory; a SOURCE is"),
    (["timeline", "preset:tiny", "--out", "x.svg"], "--out x.svg: unknown extension '.svg'; use .png or .html"),
    (["timeline", "preset:tiny"], "plan timeline needs --out FILE.png|FILE.html (or --json)"),
    (["timeline", "--out", "x.png"], "plan timeline needs a SOURCE: a config YAML file, preset:NAME or a run"),
    (["timeline", "preset:nope", "--json"], "unknown preset 'nope'"),
])
def test_errors_are_one_line(argv, match, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_run_dir_errors(tmp_path, run_dir, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run_cli(capsys, "timeline", str(empty), "--out", str(tmp_path / "x.html"))
    assert rc == 2 and err.count("\n") == 1
    assert f"{empty}: no pp_timeline/rank<r>.json files in this directory" in err
    rc, _, err = run_cli(capsys, "timeline", str(run_dir), "parallel.pp=2", "--json")
    assert rc == 2 and "overrides (parallel.pp=2) apply to config sources" in err
    not_config = tmp_path / "notes.txt"
    not_config.write_text("x")
    rc, _, err = run_cli(capsys, "timeline", str(not_config), "--json")
    assert rc == 2 and "notes.txt: not a config (.yaml) or a run directory" in err


def test_png_without_matplotlib_names_the_install(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    rc, _, err = run_cli(capsys, "timeline", str(run_dir), "--out", str(tmp_path / "x.png"))
    assert rc == 2 and err.count("\n") == 1 and "pip install matplotlib" in err
    assert not (tmp_path / "x.png").exists()
