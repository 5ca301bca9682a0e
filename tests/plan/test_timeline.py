"""The timeline format: per-rank files of a measured run (writer, reader), merging, orders, one-line errors."""

import json

import pytest

from moetrain.errors import UserError
from moetrain.plan.simulator import simulate
from moetrain.plan.timeline import RankTimelineWriter, read_run

META = {"schedule": "1f1b", "pp": 2, "vpp": 1, "micro_batches": 2}


def op(kind, mb, start, end, stage, chunk=0):
    return {"kind": kind, "micro_batch": mb, "stage": stage, "chunk": chunk, "start": start, "end": end}


# A measured 1F1B step on 2 ranks (seconds since each rank's step start).
RANK0 = [op("F", 0, 0.0, 1.0, 0), op("F", 1, 1.0, 2.0, 0), op("B", 0, 4.5, 6.5, 0), op("B", 1, 7.5, 9.5, 0)]
RANK1 = [op("F", 0, 1.2, 2.2, 1), op("B", 0, 2.2, 4.2, 1), op("F", 1, 4.2, 5.2, 1), op("B", 1, 5.2, 7.2, 1)]


def write_run(out_dir, steps=(3,), meta=META, ranks=(0, 1)):
    for r in ranks:
        w = RankTimelineWriter(out_dir, r, meta)
        for step in steps:
            w.add_step(step, RANK0 if r == 0 else RANK1, 10.0 + r + step / 10)
        w.close()


def test_round_trip_merges_the_ranks(tmp_path):
    write_run(tmp_path, steps=(3, 4))
    f0 = json.loads((tmp_path / "pp_timeline" / "rank0.json").read_text())
    assert {k: f0[k] for k in ("rank", "schedule", "pp", "vpp", "micro_batches")} == {"rank": 0, **META}
    assert [s["step"] for s in f0["steps"]] == [3, 4] and f0["steps"][0]["ops"] == RANK0
    assert not list((tmp_path / "pp_timeline").glob("*.tmp*"))  # written through a temporary file, renamed

    tl = read_run(tmp_path)  # the last step by default
    assert (tl.source, tl.step, tl.schedule, tl.pp, tl.micro_batches) == ("measured", 4, "1f1b", 2, 2)
    assert tl.step_time == 9.5
    assert tl.peak_mem_gib == [10.4, 11.4]
    assert tl.busy(0) == pytest.approx(6.0) and tl.bubble_fraction(1) == pytest.approx(1 - 6.0 / 9.5)
    assert tl.gaps(0) == [(2.0, 4.5), (6.5, 7.5)]
    assert read_run(tmp_path, step=3).peak_mem_gib == [10.3, 11.3]
    d = tl.to_dict()
    assert d["ranks"][1]["ops"][0] == {"kind": "F", "micro_batch": 0, "chunk": 0, "stage": 1, "start": 1.2, "end": 2.2}
    assert d["ranks"][0]["peak_mem_gib"] == 10.4 and d["step_time_s"] == 9.5


def test_measured_order_equals_the_simulated_one(tmp_path):
    write_run(tmp_path)
    sim = simulate("1f1b", 2, 1, 2, [1.0, 1.0], [2.0, 2.0])
    assert read_run(tmp_path).orders() == sim.orders() == [
        [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)],
        [("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1)]]


def test_orders_sort_by_start(tmp_path):
    w = RankTimelineWriter(tmp_path, 0, {**META, "pp": 1})
    w.add_step(1, [RANK0[2], RANK0[0], RANK0[3], RANK0[1]], None)
    tl = read_run(tmp_path)
    assert tl.orders() == [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]]
    assert tl.peak_mem_gib == [None] and tl.to_dict()["ranks"][0]["peak_mem_gib"] is None


def test_a_resumed_run_keeps_the_recorded_steps(tmp_path):
    write_run(tmp_path, steps=(3,))
    write_run(tmp_path, steps=(5,))  # a new writer (restart) on the same files
    assert [s["step"] for s in json.loads((tmp_path / "pp_timeline" / "rank1.json").read_text())["steps"]] == [3, 5]
    assert read_run(tmp_path).step == 5 and read_run(tmp_path, step=3).step == 3


def test_reads_the_pp_timeline_directory_itself(tmp_path):
    write_run(tmp_path)
    assert read_run(tmp_path / "pp_timeline").orders() == read_run(tmp_path).orders()


@pytest.mark.parametrize("setup, match", [
    (lambda d: None, "no pp_timeline/rank<r>.json files (a pipeline run writes them with profile.dump_pp_data=true"),
    (lambda d: write_run(d, ranks=(0,)), "pp = 2 needs rank0.json..rank1.json; missing rank 1"),
    (lambda d: (write_run(d, ranks=(0,)), write_run(d, ranks=(1,), meta={**META, "schedule": "interleaved"})),
     "the rank files disagree: rank0.json has 1f1b pp=2 vpp=1 micro-batches=2, rank1.json has interleaved"),
    (lambda d: (write_run(d, steps=(3, 4), ranks=(0,)), write_run(d, steps=(5,), ranks=(1,))),
     "no step was recorded by every rank (recorded: rank 0: [3, 4], rank 1: [5])"),
    (lambda d: ((d / "pp_timeline").mkdir(), (d / "pp_timeline" / "rank0.json").write_text("{not json")),
     "rank0.json: not a pipeline timeline file (not JSON"),
    (lambda d: ((d / "pp_timeline").mkdir(), (d / "pp_timeline" / "rank0.json").write_text('{"rank": 0}')),
     "rank0.json: not a pipeline timeline file (missing schedule, pp, vpp, micro_batches, steps)"),
])
def test_errors_are_one_line(tmp_path, setup, match):
    setup(tmp_path)
    with pytest.raises(UserError) as err:
        read_run(tmp_path)
    assert match in str(err.value) and "\n" not in str(err.value)


def test_missing_step(tmp_path):
    write_run(tmp_path, steps=(3, 4))
    with pytest.raises(UserError, match=r"step 7 was not recorded by every rank; steps recorded by all: \[3, 4\]"):
        read_run(tmp_path, step=7)


def test_writer_refuses_ops_without_the_keys(tmp_path):
    w = RankTimelineWriter(tmp_path, 0, META)
    with pytest.raises(ValueError, match="missing \\['chunk'\\]"):
        w.add_step(1, [{"kind": "F", "micro_batch": 0, "stage": 0, "start": 0.0, "end": 1.0}], None)
    assert not (tmp_path / "pp_timeline" / "rank0.json").exists()
