"""`moetrain plan tune`: the composed stage costs equal the planner's, bounds are lower bounds, the pruned search finds
what an exhaustive one finds, every candidate passes `moetrain train`'s config check and fits, the search is
deterministic, recompute ids follow each rank's headroom, layouts are optimal splits."""

import dataclasses
import itertools
import json
import random

import pytest

from moetrain.config.load import load_config
from moetrain.plan import activations as A
from moetrain.plan.costs import Roofline
from moetrain.plan.hardware import load_hardware
from moetrain.plan.layout import parse_layout
from moetrain.plan.memory import AT_RISK, GiB, block_mode, project_memory, stage_params
from moetrain.plan.perf import project_perf, stage_times
from moetrain.plan.tune import Options, tune
from moetrain.plan.tune_costs import StageCosts
from moetrain.plan.tune_layouts import even, layouts, min_max_split
from moetrain.plan.tune_recompute import choose, drop_order
from moetrain.plan.tune_report import official, override_args
from moetrain.plan.tune_space import Space

H200 = load_hardware("h200-sxm")
# DeepSeek-V3's block kinds (MLA, dense and MoE layers, shared expert, MTP) at a depth and width a test can search
DS = ["model.num_layers=6", "moe.first_k_dense=1", "moe.num_experts=16", "train.seq_length=1024"]


def ds(*over):
    return load_config(preset="deepseek-v3", overrides=DS + list(over))


def small_h200(gib: float):
    return dataclasses.replace(H200, hbm_gib=gib)


def loader(base_over):
    return lambda over: load_config(preset="deepseek-v3", overrides=DS + base_over + over)


def test_stage_costs_compose_the_planners_stage_times_and_params_exactly():
    c = ds("parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved", "parallel.dp=4", "parallel.ep=4",
           "parallel.pipeline_layout=Et|tt|t|ttmL", "train.global_batch_size=64", "train.micro_batch_size=2",
           "train.recompute=selective", "train.recompute_layer_ids=[1,6]")
    lay = parse_layout(c)
    costs = StageCosts(c, H200)
    d, rf = A.resolve_dims(c), Roofline(H200, c.precision.dtype)
    block_params = {}
    for st in lay.stages:
        block_params.update(stage_params(c, st).by_block)
    exact = stage_times(c, H200, d, rf, lay, None, {"block_params": block_params})
    for st, ex in zip(lay.stages, exact):
        w = costs.stage_work(st, lambda g: block_mode(c, g))
        assert (w.f, w.b, w.w, w.comm) == pytest.approx((ex.f, ex.b, ex.w, ex.comm), rel=1e-12)
        p, sp = costs.stage_params(st), stage_params(c, st)
        assert (p.dense, p.expert, p.blocks) == (sp.dense, sp.expert, len(sp.by_block))


def test_lower_bounds_hold_for_real_options():
    """time_bound and memory_bound are below the projection of every layout, schedule and recompute of a shape."""
    over = ["parallel.pp=2", "parallel.dp=4", "parallel.ep=4", "train.global_batch_size=32", "train.micro_batch_size=1"]
    shape_cfg = ds(*over, "parallel.pipeline_layout=Ettt|tttmL")
    costs = StageCosts(shape_cfg, H200)
    t_lb, m_lb = costs.time_bound(2, 0.5), costs.memory_bound(2)
    for extra in (["parallel.pipeline_layout=Ettt|tttmL"], ["parallel.pipeline_layout=Et*5|tmL"],
                  ["parallel.pipeline_layout=Ett|t|tt|tmL", "parallel.vpp=2", "parallel.pp_schedule=interleaved"],
                  ["parallel.pipeline_layout=Ett|t|tt|tmL", "parallel.vpp=2", "parallel.pp_schedule=zero_bubble"],
                  ["parallel.pipeline_layout=Ettt|tttmL", "train.recompute=full"]):
        c = ds(*over, *extra)
        assert t_lb <= project_perf(c, H200).step_time_s
        assert m_lb <= max(r.total for r in project_memory(c, H200).ranks)


def test_rank_r_keeps_at_least_min_pp_minus_r_micro_batches_of_its_first_stage():
    """The memory bound's in-flight rule, on torch's own orders for the four schedules."""
    from moetrain.config.pipeline_layout import check_schedule
    from moetrain.errors import ConfigError
    from moetrain.plan.schedule_orders import rank_actions

    checked = 0
    for sched, vpps in (("1f1b", [1]), ("interleaved", [2, 3]), ("zero_bubble", [2]), ("dualpipev", [2])):
        for pp, v, m in itertools.product((2, 3, 4, 8), vpps, (1, 2, 3, 5, 8, 12, 16, 24)):
            try:
                check_schedule(sched, pp, v, m)
            except ConfigError:
                continue
            for r, order in enumerate(rank_actions(sched, pp, v, m)):
                kept = most = 0
                for a in order:
                    if a.stage == r:
                        kept += {"F": 1, "I": -1, "B": -1}.get(a.kind, 0)
                        most = max(most, kept)
                assert most >= min(pp - r, m), (sched, pp, v, m, r)
                checked += 1
    assert checked > 300


def test_min_max_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(60):
        n_items = rng.randint(2, 9)
        costs = [rng.choice([0.5, 1.0, 1.0, 2.0, 0.1]) for _ in range(n_items)]
        n = rng.randint(1, n_items)
        sizes = min_max_split(costs, n)
        assert len(sizes) == n and min(sizes) >= 1 and sum(sizes) == n_items
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cut, cut + (n_items,)))
                   for cut in itertools.combinations(range(1, n_items), n - 1))
        ends = list(itertools.accumulate(sizes))
        got = max(sum(costs[a:b]) for a, b in zip([0] + ends[:-1], ends))
        assert got == pytest.approx(best)


def test_layouts_parse_back_with_every_layer_and_the_mtp_placements():
    from moetrain.config.pipeline_layout import layout_stages

    items = {"E": 0.1, "M": 1.5, "L": 1.0, "ML": 2.4, **{f"t{i}": (0.5 if i < 3 else 1.0) for i in range(61)}}
    texts = layouts(items, 61, 1, 32)
    assert texts == ["Et*3|(tt|)*28t|t|mL", "Et|(tt|)*29t|tmL", "Et*3|(tt|)*29m|L"]
    for text in texts:
        assert len(layout_stages(text, num_layers=61, mtp_num_layers=1, pp=16, vpp=2)) == 32
    assert even(61, 1, 32) == "Et|(tt|)*29t|tmL"  # the reference documents' shape: 1-layer stages at E, L, one more


def test_recompute_ids_follow_each_ranks_headroom():
    """Ranks with headroom give their blocks back; the peak rank keeps what it needs; every rank fits and one more
    block given back by a rank that still recomputes would not fit it."""
    c = ds("parallel.pp=2", "parallel.dp=4", "parallel.ep=4", "train.global_batch_size=64", "train.micro_batch_size=2",
           "parallel.pipeline_layout=Ettt|tttmL")
    full = project_memory(dataclasses.replace(c, train=dataclasses.replace(c.train, recompute="full")), H200)
    none = project_memory(c, H200)
    limit_gib = (none.peak.first_step + none.peak.fragmentation) / GiB * 0.97
    hw = small_h200(limit_gib / AT_RISK + 0.75 + 1.0)  # fits limit just under the no-recompute peak
    assert full.reserved_gib < AT_RISK * (hw.hbm_gib - 1.75)
    choice = choose(c, hw, "none")
    assert choice is not None and choice.ids and len(set(choice.per_rank)) > 1  # not one uniform count
    assert choice.memory.verdict == "fits"
    order = drop_order(c)
    for r, kept in enumerate(choice.per_rank):
        if kept:  # give back one more of this rank's blocks: that rank no longer fits
            ids = sorted(set(choice.ids) - {order[r][len(order[r]) - kept]})
            more = dataclasses.replace(c, train=dataclasses.replace(c.train, recompute_layer_ids=ids or None))
            rank = project_memory(more, hw).ranks[r]
            assert rank.first_step + rank.fragmentation > AT_RISK * choice.memory.usable_gib * GiB


SPACE = dict(gpus=8, global_batch=64, max_mbs=2, optim=("fp32", "bf16-grads-moments"), max_vpp=3)
GIB = 24.0  # tight enough that the winners need recompute ids and pipelines compete


def small_search(exhaustive=False, gib=GIB, top=4):
    base = ds()
    return tune(base, small_h200(gib), Space(**SPACE), Options(top_k=top, exhaustive=exhaustive))


def test_pruned_search_finds_what_an_exhaustive_search_finds():
    pruned, full = small_search(), small_search(exhaustive=True)
    key = lambda f: (round(f.step_time_s, 12), json.dumps(f.overrides, sort_keys=True))  # noqa: E731
    assert [key(f) for f in pruned.found] == [key(f) for f in full.found]
    assert pruned.stats.simulated < full.stats.simulated and pruned.stats.options < full.stats.options  # it pruned
    assert all(f.recompute.ids for f in full.found) and any(f.shape.pp > 1 for f in full.found)


def test_search_is_deterministic():
    a, b = small_search(), small_search()
    assert [(f.step_time_s, f.overrides) for f in a.found] == [(f.step_time_s, f.overrides) for f in b.found]


def test_every_candidate_passes_the_trainers_check_fits_and_projects_as_found():
    res = small_search(top=6)
    assert len(res.found) == 6
    cands = official(res, loader([]), small_h200(GIB), "auto", 1.0, 0.5)
    for c in cands:
        cfg = load_config(preset="deepseek-v3", overrides=DS + override_args(c.found.overrides))  # Config.check runs
        assert project_memory(cfg, small_h200(GIB)).verdict == "fits"
        assert cfg.parallel.cp == 1 and cfg.parallel.etp == 1  # what the trainer builds today
        assert c.perf.step_time_s == pytest.approx(c.found.step_time_s, rel=1e-9)
        assert c.memory.peak_gib == pytest.approx(c.found.peak_mem_gib, rel=1e-12)
    assert [c.perf.step_time_s for c in cands] == sorted(c.perf.step_time_s for c in cands)


def test_keys_set_on_the_command_line_stay_fixed():
    from moetrain.plan.tune_space import derive

    base = ds("parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp=4")
    res = tune(base, small_h200(GIB), Space(**SPACE, fixed=(("parallel.tp", 2),)), Options(top_k=3))
    assert res.found and all(f.overrides["parallel.tp"] == 2 for f in res.found)
    assert derive(base, res.found[0].overrides).parallel.tp == 2


CLI = ["tune", "--preset", "deepseek-v3", *DS, "--gpus", "8", "--gpu-memory", str(GIB), "--global-batch", "64",
       "--max-mbs", "2", "--optim", "fp32,bf16-grads-moments", "--max-vpp", "3"]


def test_cli_json_contract_and_the_winner_yaml(tmp_path, capsys):
    from moetrain.plan.cli import main

    out = tmp_path / "winner.yaml"
    assert main([*CLI, "--top", "3", "--json", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert "tune: [" in captured.err  # progress on stderr, JSON alone on stdout
    cands = res["candidates"]
    assert len(cands) == 3 and [c["rank"] for c in cands] == [1, 2, 3]
    assert [c["step_time_s"] for c in cands] == sorted(c["step_time_s"] for c in cands)
    for c in cands:
        assert {"overrides", "args", "step_time_s", "peak_mem_gib", "per_rank_peak_gib", "bubble_fraction",
                "comm_share", "tokens_per_s_per_gpu", "recompute", "verdict"} <= set(c)
        assert c["verdict"] == "fits" and max(c["per_rank_peak_gib"]) == pytest.approx(c["peak_mem_gib"], abs=1e-3)
        cfg = load_config(preset="deepseek-v3", overrides=DS + c["args"])
        assert {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in c["overrides"]} == c["overrides"]
    assert res["winner_yaml"] == str(out) and res["search"]["shapes"] > 0 and res["why"]
    winner = load_config(path=str(out))  # the whole config, ready for moetrain train --config
    assert project_perf(winner, small_h200(GIB)).step_time_s == pytest.approx(cands[0]["step_time_s"], rel=1e-12)
    assert main(["perf", "--preset", "deepseek-v3", *DS, *cands[0]["args"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == pytest.approx(cands[0]["step_time_s"], rel=1e-12)


@pytest.mark.parametrize("extra, match", [
    (["--gpus", "0"], "--gpus = 0"),
    (["--optim", "fp8"], "--optim 'fp8': valid names are fp32, bf16-moments"),
    (["--gpu-memory", "4"], "no configuration of deepseek-v3 on 8 x h200-sxm fits"),
    (["--top", "0"], "--top = 0"),
])
def test_cli_user_errors_are_one_line(extra, match, capsys, tmp_path):
    from moetrain.plan.cli import main

    assert main([*CLI, *extra, "--out", str(tmp_path / "w.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and match in err


def test_the_space_keeps_what_the_trainer_builds_and_plan_only_adds_cp_and_etp():
    from moetrain.plan.tune_space import shapes

    base = ds()
    space = Space(gpus=16, global_batch=64, max_mbs=1, optim=("fp32",))
    got = shapes(base, space)
    assert {s.cp for s in got} == {1} and {s.etp for s in got} == {1}
    assert {s.tp for s in got} == {1, 2, 4, 8}  # a node at most; heads 128, vocab 129280, FFN sizes divide
    assert {s.pp for s in got} == {1, 2, 4}  # 6 layers + 1 MTP depth: at most 7 stages' worth, pp dividing 16
    assert all(s.ep % s.tp == 0 or s.tp % s.ep == 0 for s in got)
    hsdp = [s for s in got if s.dp_replicate > 1]  # shards inside a node, replicas across nodes
    assert hsdp and all(s.dp // s.dp_replicate * s.tp * s.cp == 8 for s in hsdp)
    wide = shapes(base, dataclasses.replace(space, plan_only=True))
    assert {s.cp for s in wide} > {1} and {s.etp for s in wide} > {1} and set(got) < set(wide)
