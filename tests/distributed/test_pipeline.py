"""`moetrain train` with pipeline parallelism on gloo ranks against one process on the same global batch and seed:
per-step loss, grad norm, LM, aux and MTP losses within 1e-4 relative (fp32, CPU), for each schedule (1F1B,
interleaved, ZB-V, DualPipe-V), MTP on and off, explicit layouts and recompute ids; EP2 x PP2; a sharded checkpoint
saved under EP2 x PP2 resumed by one process and under TP2; evaluation, warm-up and the timing dump."""

import json

import pytest
from gloo_ranks import run_ranks
from train_runs import BASE, NO_MTP, assert_match, cfg, single, train_on_ranks

# name -> overrides; each runs on 2 ranks against the one-process run of its model. The V schedules run the experts
# on torch._grouped_mm (moe.backend=torch), whose weight gradients are deferred to the schedule's W steps (the CPU's
# default loop computes them in the backward)
SCHEDULES = {
    "1f1b": ["parallel.pp=2"],
    "interleaved_explicit_layout_no_mtp": [
        "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved", "parallel.pipeline_layout=Et|t|t|tL",
        "train.recompute_layer_ids=[1,2]", *NO_MTP],
    "zero_bubble_empty_stage": ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zero_bubble",
                                "parallel.pipeline_layout=Ett|t||tmL", "train.recompute_layer_ids=[0,4]",
                                "moe.backend=torch"],
    "dualpipev_selective_recompute": ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=dualpipev",
                                      "train.recompute=selective", "moe.backend=torch"],
}


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """The one-process runs: {"mtp": records, "no_mtp": records}."""
    return {"mtp": single(tmp_path_factory.mktemp("single")),
            "no_mtp": single(tmp_path_factory.mktemp("single"), *NO_MTP)}


def test_every_schedule_matches_one_process(singles, tmp_path):
    got = train_on_ranks(tmp_path, SCHEDULES, world_size=2)
    for name, overrides in SCHEDULES.items():
        assert_match(got[name], singles["no_mtp" if NO_MTP[0] in overrides else "mtp"], name)


def test_ep2_pp2_matches_and_its_checkpoint_resumes_in_one_process_and_under_tp2(singles, tmp_path):
    """4 ranks, EP2 x PP2 (1F1B, MTP on the last stage with its copy of the embedding), a sharded checkpoint at step
    2: the run matches one process, and one process, and TP2 x SP on two ranks, resumed from its step 2 train step 3
    as the uninterrupted run did."""
    out = tmp_path / "ep2pp2"
    got = train_on_ranks(tmp_path, {"ep2pp2": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2",
                                               "checkpoint.interval=2"]}, world_size=4)["ep2pp2"]
    assert_match(got, singles["mtp"], "EP2 x PP2")
    resume = f"checkpoint.resume={out / 'checkpoints' / 'step_2'}"
    one = single(tmp_path / "one", resume)
    assert_match(got[:2] + one, got, "resumed in one process")
    tp2 = train_on_ranks(tmp_path / "tp", {"tp2": ["parallel.tp=2", "parallel.sequence_parallel=true", resume]},
                         world_size=2)["tp2"]
    assert_match(got[:2] + tp2, got, "resumed under TP2")


def test_warm_up_and_evaluation_under_the_pipeline(tmp_path):
    """train.pp_warmup leaves the training unchanged (its gradients and counts are dropped; its inputs come from a
    generator of its own); the pipeline's evaluation gives the one-process eval loss (eval_steps = one step of
    micro-batches, so both read the same eval batches)."""
    from moetrain.train.trainer import run

    every = ["train.eval_interval=2", "train.eval_steps=4"]
    want = run(cfg(tmp_path / "single", *every), show_progress=False).records
    result_file = tmp_path / "records.json"
    run_ranks(_train_evals, str(tmp_path / "pp"), ["parallel.pp=2", "train.pp_warmup=true", *every], str(result_file),
              world_size=2)
    got = json.loads(result_file.read_text())
    assert [r.get("eval_loss") is not None for r in want] == [False, True, False]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4)
        if "eval_loss" in w:
            assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-4)


def _train_evals(rank, world_size, out_dir, overrides, result_file):
    from moetrain.train.trainer import run

    result = [{k: r[k] for k in ("loss", "eval_loss") if k in r}
              for r in run(cfg(out_dir, *overrides), show_progress=False).records]
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(result, f)


def test_overlapped_all_to_all_under_dualpipev_matches_one_process(singles, tmp_path):
    """moe.overlap_a2a: EP2 x PP2 under DualPipe-V, each overlapped pair's backward on a worker thread while its
    forward runs (three pairs per rank per step here), the two local stages dispatching over groups of their own:
    the same losses as one process, with full recompute on a layer (its recompute runs beside a forward)."""
    overrides = ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=dualpipev", "parallel.dp=2",
                 "parallel.ep=2", "moe.overlap_a2a=true", "train.global_batch_size=8", "train.recompute_layer_ids=[2]"]
    got = train_on_ranks(tmp_path, {"overlap": overrides}, world_size=4)["overlap"]
    assert_match(got, single(tmp_path / "single", "train.global_batch_size=8"), "overlapped DualPipe-V")


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_measured_timeline_follows_the_simulators_order_and_renders(schedule, tmp_path):
    """profile.dump_pp_data on a PP2 run: each rank's file holds the profiled steps; the merged timeline's per-rank
    order of (kind, micro-batch, stage) equals the planner's simulation of the same config (torch's orders), and
    `moetrain plan timeline` draws it beside the simulated one."""
    from moetrain.cli import main
    from moetrain.plan.simulator import simulate
    from moetrain.plan.timeline import read_run

    vpp = ["parallel.vpp=2", "parallel.pp_schedule=zero_bubble", "moe.backend=torch"] if schedule != "1f1b" else []
    overrides = ["parallel.pp=2", *vpp, "profile.dump_pp_data=true", "profile.start_step=2", "profile.end_step=3"]
    run_dir = tmp_path / "pp"
    train_on_ranks(tmp_path, {"pp": overrides}, world_size=2)
    measured = read_run(run_dir)
    assert (measured.source, measured.step, measured.schedule) == ("measured", 3, schedule)
    assert read_run(run_dir, step=2).orders() == measured.orders()
    v = 2 if vpp else 1
    simulated = simulate(schedule, 2, v, 4, [1.0] * (2 * v), [1.0] * (2 * v), [1.0] * (2 * v))
    assert measured.orders() == simulated.orders()
    kinds = {kind for rank in measured.orders() for kind, _, _ in rank}
    assert kinds == ({"F", "B", "W"} if vpp else {"F", "B"})
    out = tmp_path / "timeline.png"
    same_config = [*BASE[:4], *overrides[:-3]]
    assert main(["plan", "timeline", str(run_dir), "preset:tiny", *same_config, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
