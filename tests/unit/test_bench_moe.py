"""The MoE layer benchmark's contenders compute the same function (CPU, fp64, small shape), and its table says what
it timed."""

import json

import pytest
import torch

from moetrain.bench.moe_layer import Shape, forcing_logits, layer_flops, ours, reference_layer, six_gemms


def test_forcing_gives_the_requested_routing():
    s = Shape("t", T=12, H=8, I=4, E=6, K=2)
    bal = forcing_logits(s, "balanced", "cpu")
    chosen = bal.topk(2, dim=-1).indices
    assert torch.equal(chosen, (torch.arange(12).unsqueeze(1) * 2 + torch.arange(2)) % 6)
    skew = forcing_logits(Shape("t", T=4000, H=8, I=4, E=8, K=2), "skewed", "cpu", seed=1)
    counts = torch.bincount(skew.topk(2, dim=-1).indices.flatten(), minlength=8).float()
    assert counts.max() / counts.mean() > 1.5  # Dirichlet(0.3) shares are far from uniform


def test_contenders_agree():
    s = Shape("t", T=24, H=16, I=8, E=4, K=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s.T, s.H, generator=g, dtype=torch.float64)
    router_w = torch.randn(s.E, s.H, generator=g, dtype=torch.float64)
    w1 = torch.randn(s.E, 2 * s.I, s.H, generator=g, dtype=torch.float64)
    w2 = torch.randn(s.E, s.H, s.I, generator=g, dtype=torch.float64)
    forcing = forcing_logits(s, "balanced", "cpu").double()
    want = reference_layer(x, router_w, forcing, w1, w2, s.K, per_expert_loop=True)
    got = ours("reference")(x, router_w, forcing, w1, w2, s.K)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # routing weights are fp32
    assert layer_flops(s) == 3 * 6 * s.T * s.K * s.H * s.I


def test_six_gemms_are_the_layers_grouped_gemms():
    s = Shape("t", T=12, H=16, I=8, E=3, K=2)  # 16-byte strides and no empty group: torch's CPU grouped GEMM
    run = six_gemms(s, "balanced", "cpu", dtype=torch.float32)
    x, a, dy, dh, w1, w2, offs = run.operands
    outs = run()
    assert [tuple(o.shape) for o in outs] == [(24, 16), (24, 16), (24, 8), (3, 16, 8), (24, 16), (3, 16, 16)]
    s0, e0 = 0, int(offs[0])  # expert 0's rows
    torch.testing.assert_close(outs[0][s0:e0], x[s0:e0] @ w1[0].T)
    torch.testing.assert_close(outs[2][s0:e0], dy[s0:e0] @ w2[0])
    torch.testing.assert_close(outs[3][0], dy[s0:e0].T @ a[s0:e0])
    torch.testing.assert_close(outs[5][0], dh[s0:e0].T @ x[s0:e0])


def test_skewed_routing_takes_its_concentration_and_says_how_uneven_it_is():
    from moetrain.bench.moe_layer import routing_line, routing_stats, skew_alpha

    assert skew_alpha("balanced") is None and skew_alpha("skewed") == 0.3 and skew_alpha("skewed:2.5") == 2.5
    s = Shape("t", T=4000, H=8, I=4, E=16, K=2)
    assert torch.equal(forcing_logits(s, "skewed:0.3", "cpu"), forcing_logits(s, "skewed", "cpu"))

    def max_over_mean(routing):
        counts = torch.bincount(forcing_logits(s, routing, "cpu").topk(2, dim=-1).indices.flatten(), minlength=16)
        return (counts.max() / counts.float().mean()).item()

    assert max_over_mean("skewed:0.1") > max_over_mean("skewed:3") > max_over_mean("balanced") == 1.0
    line = routing_line(s, "balanced", routing_stats(s, "balanced"))
    assert line == "  t balanced: rows per expert max / mean 1.00, CV 0.00, 0 of 16 experts empty"
    assert f"max / mean {max_over_mean('skewed:3'):.2f}," in routing_line(s, "skewed:3", routing_stats(s, "skewed:3"))


def test_skewed_routing_is_the_same_on_every_call():
    s = Shape("t", T=64, H=8, I=4, E=8, K=2)
    first = forcing_logits(s, "skewed", "cpu", seed=3)
    torch.rand(5)  # the global generator moves on
    assert torch.equal(forcing_logits(s, "skewed", "cpu", seed=3), first)


@pytest.mark.parametrize("argv, match", [(["--shapes", "qwen3"], "unknown shape 'qwen3'"),
                                         (["--tokens", "0"], "at least 1 token"),
                                         (["--routing", "balanced,uniform"], "unknown routing 'uniform'"),
                                         (["--routing", "skewed:0"], "unknown routing 'skewed:0'"),
                                         (["--routing", "skewed:x"], "unknown routing 'skewed:x'"),
                                         (["--routing", "skewed:inf"], "unknown routing 'skewed:inf'"),
                                         (["--fp8", "rowwise,mx"], "--fp8 mx: not an FP8 recipe")])
def test_bad_arguments_are_one_line_errors_before_any_gpu_check(argv, match):
    from moetrain.bench.moe_layer import main
    from moetrain.errors import UserError

    with pytest.raises(UserError, match=match):
        main(argv)


def test_skew_summary_compares_each_contender_across_routings():
    from moetrain.bench.moe_report import skew_summary

    rows = [{"shape": "a", "routing": "balanced", "contender": "ours", "ms": 10.0},
            {"shape": "a", "routing": "balanced", "contender": "ref", "ms": 20.0},
            {"shape": "a", "routing": "skewed", "contender": "ours", "ms": 11.5},
            {"shape": "a", "routing": "skewed", "contender": "ref", "ms": 19.0},
            {"shape": "b", "routing": "balanced", "contender": "ours", "ms": 5.0}]  # one routing only: no line
    assert skew_summary(rows) == ["a: skewed over balanced: ours +15.0%, ref -5.0%"]
    rows.insert(3, {"shape": "a", "routing": "skewed:2", "contender": "ours", "ms": 10.5})  # another concentration
    assert skew_summary(rows) == ["a: skewed over balanced: ours +15.0%, ref -5.0%",
                                  "a: skewed:2 over balanced: ours +5.0%"]


def test_host_ahead_rows_are_divided_by_the_host_ahead_floor_and_reference():
    # a GPU that idled before a call runs it at higher clocks: each row is compared with the peers timed the same way
    from moetrain.bench import moe_layer as ml

    s = Shape("t", T=8, H=4, I=2, E=2, K=1)
    timed = {name: (ms, 1.0, 0.5, 0, [ms, ms + 0.1]) for name, ms in {
        "reference eager": 20.0, "ours (auto)": 10.0, ml.FLOOR: 5.0, "reference eager, host ahead": 16.0,
        "ours (auto), host ahead": 9.0, f"{ml.FLOOR}, host ahead": 6.0}.items()}
    rows = {r["contender"]: r for r in ml.table_rows(s, "balanced", timed, dict.fromkeys(timed, 0.0), {})}
    assert rows["ours (auto)"]["vs_gemms"] == 2.0 and rows["ours (auto)"]["vs_eager"] == 2.0
    assert rows["ours (auto), host ahead"]["vs_gemms"] == 1.5 and rows["ours (auto), host ahead"]["vs_eager"] == 16 / 9
    assert rows[f"{ml.FLOOR}, host ahead"]["vs_gemms"] == 1.0
    assert all(rows[name]["peak_gib"] != rows[name]["peak_gib"] for name in (ml.FLOOR, f"{ml.FLOOR}, host ahead"))
    assert rows["ours (auto)"]["peak_gib"] == 1.0 and rows["ours (auto)"]["reps_ms"] == [10.0, 10.1]
    assert rows["ours (auto), host ahead"]["vs_gemms_paired"] == pytest.approx((9 / 6 + 9.1 / 6.1) / 2)
    assert rows["ours (auto), host ahead"]["paired_range"] == pytest.approx((9.1 / 6.1, 9 / 6))
    # without host-ahead twins every row is divided by the plain floor and reference
    del timed["reference eager, host ahead"], timed[f"{ml.FLOOR}, host ahead"]
    rows = {r["contender"]: r for r in ml.table_rows(s, "balanced", timed, dict.fromkeys(timed, 0.0), {})}
    assert rows["ours (auto), host ahead"]["vs_gemms"] == 1.8 and rows["ours (auto), host ahead"]["vs_eager"] == 20 / 9


def test_the_host_ahead_floor_replays_the_six_gemms(monkeypatch):
    from moetrain.bench import moe_timing as mt

    monkeypatch.setattr(mt.HostAhead, "_lead", ("queued GEMM operands",))  # made on a GPU otherwise
    floor, replayed = mt.GemmFloor(lambda w1, w2: None), []
    monkeypatch.setattr(floor, "replay", replayed.append)
    mt.fwd_bwd(mt.HostAhead(floor), "args")
    mt.fwd_bwd(floor, "more args")
    assert replayed == ["args", "more args"]
    assert mt.floor_of(mt.HostAhead(reference_layer)) is None and mt.floor_of(reference_layer) is None


def test_the_floor_runs_six_gemms_on_the_contenders_weights():
    from moetrain.bench import moe_timing as mt

    made, ran = [], []
    floor = mt.GemmFloor(lambda w1, w2: made.append((w1, w2)) or (lambda keep: ran.append(keep)))
    w1, w2 = torch.ones(2, 4, 4, requires_grad=True), torch.ones(2, 4, 2, requires_grad=True)
    args = (None, None, None, w1, w2, 1, None)
    floor.replay(args)
    floor.replay(args)  # the same inputs: built once
    assert len(made) == 1 and not made[0][0].requires_grad and ran == [False, False]


def test_tokens_replace_every_shapes_token_count(monkeypatch, capsys):
    from moetrain.bench import moe_layer as ml

    ran = []
    monkeypatch.setattr(ml.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ml.torch.cuda, "get_device_name", lambda *a: "a fake GPU")
    monkeypatch.setattr(ml, "parse_backends", lambda names, device: ["triton"])
    monkeypatch.setattr(ml, "run_shape", lambda s, routing, *a: ran.append((s, routing)) or [])
    ml.main(["--shapes", "qwen3-30b-a3b,deepseek-v3", "--routing", "balanced", "--tokens", "4096"])
    assert [(s.name, s.T, s.H, s.E, r) for s, r in ran] == [("qwen3-30b-a3b", 4096, 2048, 128, "balanced"),
                                                            ("deepseek-v3", 4096, 7168, 256, "balanced")]
    assert "4096 tokens per call at every shape" in capsys.readouterr().out
    assert ml.SHAPES["qwen3-30b-a3b"].T == 16384  # the table itself is unchanged


def test_main_prints_and_saves_the_rows_table_rows_makes(monkeypatch, capsys, tmp_path):
    from moetrain.bench import moe_layer as ml

    def run_shape(s, routing, *a):
        timed = {name: (ms, 1.0, 0.5, 0, [ms, ms * 1.1]) for name, ms in
                 {"reference eager": 20.0, "ours (triton)": 10.0, ml.FLOOR: 8.0}.items()}
        return ml.table_rows(s, routing, timed, dict.fromkeys(timed, 0.0), {})

    monkeypatch.setattr(ml.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ml.torch.cuda, "get_device_name", lambda *a: "a fake GPU")
    monkeypatch.setattr(ml, "parse_backends", lambda names, device: ["triton"])
    monkeypatch.setattr(ml, "run_shape", run_shape)
    ml.main(["--shapes", "qwen3-30b-a3b", "--routing", "balanced", "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out.splitlines()
    ours = next(line for line in out if "ours (triton)" in line)
    assert ours.split()[-7:] == ["2.00", "1.25", "1.250", "1.250-1.250", "1.00", "0.0e+00", "0"]
    assert "  qwen3-30b-a3b balanced: rows per expert max / mean 1.00, CV 0.00, 0 of 128 experts empty" in out
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert [r["paired_range"] for r in saved if r["contender"] == "ours (triton)"] == [[1.25, 1.25]]
    assert {(r["rows_max_over_mean"], r["rows_cv"], r["empty_experts"]) for r in saved} == {(1.0, 0.0, 0)}


def test_the_paired_ratio_takes_each_round_against_the_same_rounds_floor():
    from moetrain.bench.moe_report import paired_range, paired_ratio

    # the machine slows down over the rounds: every round ours is 1.02x the floor, the ratio of the medians 0.68
    ours, floor = [10.2, 10.2, 15.3], [10.0, 15.0, 15.0]
    assert paired_ratio(ours, floor) == pytest.approx(1.02)
    assert sorted(ours)[1] / sorted(floor)[1] == pytest.approx(0.68)
    assert paired_range(ours, floor) == pytest.approx((0.68, 1.02))  # the second round alone: 10.2 / 15.0
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        paired_range([1.0], [1.0, 2.0])


def test_a_table_line_shows_the_rounds_range_under_its_header():
    from moetrain.bench.moe_report import TABLE_HEADER, table_line

    row = {"shape": "qwen3-30b-a3b", "routing": "skewed", "contender": "ours (auto), host ahead", "ms": 6.98,
           "spread_pct": 1.1, "tflops": 531.7, "vs_eager": 2.02, "vs_gemms": 1.03, "vs_gemms_paired": 1.035,
           "paired_range": (1.002, 1.046), "peak_gib": 0.95, "rel_err": 6.2e-3, "alloc_events": 0}
    line = table_line(row)
    assert line.split()[-7:] == ["2.02", "1.03", "1.035", "1.002-1.046", "0.95", "6.2e-03", "0"]
    # each value sits under its column's name
    for name, value in (("paired", "1.035"), ("range", "1.002-1.046"), ("peak GiB", "0.95"), ("mallocs", "0")):
        assert TABLE_HEADER.index(name) + len(name) == line.rindex(value) + len(value)
