"""`moetrain plan tune --validate` plumbing on the CPU: which candidates run as themselves or as one-GPU proxies, what a
proxy keeps of the candidate's per-GPU work, the commands, reading a run, the rankings, the CLI with a fake runner;
and one real subprocess run of the tiny preset through the same runner."""

import json

import pytest

from moetrain.config.load import load_config
from moetrain.plan import tune_validate as V
from moetrain.plan.hardware import load_hardware
from moetrain.plan.memory import project_memory
from moetrain.plan.perf import project_perf
from moetrain.plan.tune import Options, tune
from moetrain.plan.tune_report import official
from moetrain.plan.tune_space import Space, derive

DS = ["model.num_layers=6", "moe.first_k_dense=1", "moe.num_experts=16", "train.seq_length=1024"]
H200 = load_hardware("h200-sxm")


@pytest.fixture(scope="module")
def cands():
    base = load_config(preset="deepseek-v3", overrides=DS)
    res = tune(base, H200, Space(gpus=8, global_batch=64, max_mbs=2, optim=("fp32",), max_vpp=2), Options(top_k=10))
    return official(res, lambda over: load_config(preset="deepseek-v3", overrides=DS + over), H200, "auto", 1.0, 0.5)


def test_one_gpu_runs_proxies_of_each_candidates_per_gpu_work(cands, tmp_path):
    runs = V.plan_runs(cands, H200, 1, 139.8, 3, 8, str(tmp_path))
    assert len(runs) == 3 and all(r.kind == "proxy" and r.nproc == 1 for r in runs)
    order = [r.candidate for r in runs]
    assert order == sorted(order) and order[0] == 1
    texts = [open(r.config_path).read() for r in runs]
    assert len(set(texts)) == 3  # distinct configs: candidates whose proxy repeats an earlier one are skipped
    for run in runs:
        p, full = run.cfg, cands[run.candidate - 1].cfg
        assert p.parallel.world_size == 1 and p.parallel.pp == p.parallel.tp == p.parallel.ep == 1
        assert p.moe.num_experts == max(16 // full.parallel.ep, 8) and p.moe.topk == 8  # local experts, same rows
        assert full.model.mtp_num_layers == 1 and p.model.mtp_num_layers == 0  # one rank's work at scale
        assert p.train.micro_batch_size == full.train.micro_batch_size and p.grad_accum_steps == 2
        assert (p.optim.exp_avg_dtype, p.optim.main_grads_dtype) == (full.optim.exp_avg_dtype,
                                                                     full.optim.main_grads_dtype)
        k = p.model.num_layers  # the deepest that fits one H200
        assert project_memory(p, H200).verdict == "fits"
        assert k == 6 or project_memory(derive(full, V.proxy_overrides(full, k + 1)), H200).verdict != "fits"
        written = load_config(path=run.config_path)
        assert run.projected_s == pytest.approx(project_perf(written, H200, dp_overlap=0.0).step_time_s)
        assert run.projected_gib == pytest.approx(project_memory(written, H200).peak_gib)
        assert run.command()[1:4] == ["-m", "moetrain", "train"] and "train.steps=8" in run.command()


def test_proxy_depth_shrinks_to_what_fits_the_gpu(cands, tmp_path):
    import dataclasses

    gpu = dataclasses.replace(H200, hbm_gib=100.0)
    small = V.plan_runs(cands, H200, 1, 100.0, 1, 8, str(tmp_path))
    layers = small[0].cfg.model.num_layers
    assert 1 <= layers < 6 and project_memory(small[0].cfg, gpu).verdict == "fits"
    deeper = V.proxy_overrides(cands[0].cfg, layers + 1)
    assert project_memory(derive(cands[0].cfg, deeper), gpu).verdict != "fits"  # the deepest that fits
    assert V.plan_runs(cands, H200, 1, 40.0, 1, 8, str(tmp_path)) == []  # not even one layer: left out


def test_enough_gpus_run_the_candidate_itself_under_torchrun(cands, tmp_path):
    runs = V.plan_runs(cands, H200, 8, 139.8, 3, 8, str(tmp_path))
    assert all(r.kind == "real" and r.nproc == 8 for r in runs)
    cmd = runs[0].command()
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    if runs[0].cfg.parallel.pp > 1:
        assert "profile.dump_pp_data=true" in cmd


def test_read_measurement_takes_the_median_after_warm_up_and_the_largest_peak(tmp_path):
    recs = [{"step_time_s": t, "peak_mem_gib": m} for t, m in ((9.0, 10.0), (5.0, 12.5), (1.0, 11.0), (3.0, 11.0),
                                                               (2.0, 11.0))]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    got = V.read_measurement(str(tmp_path))
    assert got["step_time_s"] == 2.0 and got["peak_mem_gib"] == 12.5


def test_rankings_and_errors_with_a_fake_runner(cands, tmp_path, capsys):
    factors = iter([1.10, 0.80, 1.00])  # measured = projected / factor: the second run turns out slowest
    fake = lambda run: {"step_time_s": run.projected_s / next(factors), "peak_mem_gib": run.projected_gib}
    s = V.run_validation(cands, H200, top=3, steps=5, out_dir=str(tmp_path), runner=fake,
                         machine=(1, "NVIDIA H200", 139.8))
    proj = {r["candidate"]: r["projected_step_s"] for r in s["runs"]}
    meas = {r["candidate"]: r["measured_step_s"] for r in s["runs"]}
    assert s["projected_order"] == sorted(proj, key=proj.get) and s["measured_order"] == sorted(meas, key=meas.get)
    assert [r["step_error_pct"] for r in s["runs"]] == pytest.approx([10.0, -20.0, 0.0])
    assert s["tuner_order"] == sorted(proj) and json.loads((tmp_path / "summary.json").read_text()) == s
    assert V.spearman([1, 2, 3], [1, 2, 3]) == 1.0 and V.spearman([1, 2, 3], [3, 2, 1]) == -1.0
    assert "Spearman" in V.text(s)


def test_cli_validate_with_a_fake_machine_and_runner(monkeypatch, tmp_path, capsys):
    from moetrain.plan.cli import main

    monkeypatch.setattr(V, "local_gpus", lambda: (1, "NVIDIA H200", 139.8))
    monkeypatch.setattr(V, "subprocess_runner", lambda run: {"step_time_s": run.projected_s * 1.05,
                                                             "peak_mem_gib": run.projected_gib})
    rc = main(["tune", "--preset", "deepseek-v3", *DS, "--gpus", "8", "--global-batch", "64", "--max-mbs", "2",
               "--optim", "fp32", "--max-vpp", "2", "--top", "8", "--json", "--out", str(tmp_path / "w.yaml"),
               "--validate", "--validate-top", "2", "--steps", "4", "--validate-out", str(tmp_path / "v")])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    runs = res["validation"]["runs"]
    assert [r["kind"] for r in runs] == ["proxy", "proxy"]
    assert all(r["step_error_pct"] == pytest.approx(100 * (1 / 1.05 - 1)) for r in runs)


def test_validate_refuses_without_a_gpu(cands, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from moetrain.errors import UserError

    with pytest.raises(UserError, match="runs the real trainer on CUDA GPUs"):
        V.run_validation(cands, H200, out_dir=str(tmp_path))


def test_the_subprocess_runner_trains_a_config_and_reads_its_metrics(tmp_path):
    """One real run through the runner (the tiny preset on the CPU, 4 steps)."""
    from moetrain.config.load import dump_config

    cfg = load_config(preset="tiny", overrides=["train.device=cpu"])
    run = V.Run("tiny", 1, "proxy", cfg, 1, config_path=str(tmp_path / "c.yaml"), out_dir=str(tmp_path / "run"),
                steps=4)
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    got = V.subprocess_runner(run)
    assert "error" not in got, got
    assert len(got["step_times_s"]) == 4 and got["step_time_s"] > 0 and got["peak_mem_gib"] >= 0
