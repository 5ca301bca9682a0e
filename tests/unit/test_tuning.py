"""moetrain.tuning: the one tuner (memo, cache file, timing protocol, pick rule, rank 0's answer), on CPU with a
timer passed in. Runs return their fake time; the fake timer calls the run and returns what it returns."""

import json

import pytest
import torch

from moetrain import tuning
from moetrain.tuning import cache, protocol

X = torch.zeros(8, 4)  # the questions' tensor: its dtype and device are part of the key


def table_timer(calls=None):
    def timer(run, reps):
        ms = run()
        if calls is not None:
            calls.append((ms, reps))
        return ms
    return timer


def ask(tuner, candidates, balanced, skewed=None, kind="k", peer=None, fallback=None, n=3, rows=8):
    runs = (lambda c: balanced[c],) + ((lambda c: skewed[c],) if skewed is not None else ())
    with tuning.use(tuner):
        return tuning.choose(kind, X, n, 4, rows, 2, candidates, runs, peer=peer, fallback=fallback)


def test_key_buckets_rows_per_group_and_names_everything_that_matters():
    assert [cache.rows_bucket(r * 8, 8) for r in (1, 2, 3, 4, 5, 64, 65, 128, 129)] == [1, 2, 4, 4, 8, 64, 128, 128,
                                                                                          256]
    assert cache.rows_bucket(0, 8) == cache.rows_bucket(5, 8) == 1
    key = lambda rows, dtype=torch.bfloat16, kind="gemm_fwd": cache.key_string(  # noqa: E731
        kind, dtype, torch.device("cpu"), 1536, 2048, rows, 128, (True,))
    assert key(65 * 128) == key(128 * 128) != key(64 * 128)
    assert key(1024) != key(1024, torch.float16) and key(1024) != key(1024, kind="gemm_fwd+torch")
    assert f"torch {torch.__version__}" in key(1024) and "|True|" in key(1024)


def test_miss_measures_records_and_a_new_process_reads_the_file(tmp_path):
    calls = []
    tuner = tuning.Tuner(timer=table_timer(calls), cache_file=tmp_path / "t.json")
    assert ask(tuner, ("a", "b"), {"a": 2.0, "b": 1.5}) == "b"
    (decision,) = tuner.decisions
    assert decision.choice == "b" and decision.ms["a"] == [2.0] and decision.ms["b"] == [1.5]
    entry = json.loads((tmp_path / "t.json").read_text())["entries"][decision.key]
    assert entry["choice"] == "b" and entry["ms"] == {"a": [2.0], "b": [1.5]}
    n = len(calls)
    assert ask(tuner, ("a", "b"), {"a": 2.0, "b": 1.5}) == "b" and len(calls) == n  # the memo
    fresh = tuning.Tuner(timer=table_timer(calls), cache_file=tmp_path / "t.json")
    assert ask(fresh, ("a", "b"), {"a": 9.0, "b": 9.9}) == "b" and len(calls) == n  # the file
    assert fresh.from_cache == [decision.key] and fresh.decisions == []
    # a cached winner that is no longer a candidate is measured again
    assert ask(tuning.Tuner(timer=table_timer(), cache_file=tmp_path / "t.json"), ("a", "c"),
               {"a": 2.0, "c": 1.0}) == "c"


def test_every_candidate_is_timed_in_turns_then_the_finalists_longer():
    calls = []
    tuner = tuning.Tuner(timer=table_timer(calls))
    cands = tuple("abcde")
    assert ask(tuner, cands, dict(zip(cands, (1.0, 1.1, 1.2, 3.0, 4.0)))) == "a"
    short = [ms for ms, reps in calls if reps == protocol.REPS]
    final = [ms for ms, reps in calls if reps == protocol.FINAL_REPS]
    assert len(short) == len(cands) * protocol.ROUNDS
    assert sorted(set(final)) == [1.0, 1.1, 1.2] and len(final) == protocol.FINALISTS * protocol.FINAL_ROUNDS


def test_the_long_pass_decides():
    first = {"a": 1.0, "b": 1.1, "c": 1.2, "d": 3.0}
    second = {"a": 1.3, "b": 1.05, "c": 1.2, "d": 0.5}  # d is no finalist: its long time is never taken

    def timer(run, reps):
        return (first if reps == protocol.REPS else second)[run()]

    assert ask(tuning.Tuner(timer=timer), tuple(first), {c: c for c in first}) == "b"


def test_both_routings_count_a_config_fast_on_one_only_loses():
    fast, steady = "fast", "steady"
    balanced, skewed = {fast: 7.5, steady: 8.9}, {fast: 12.0, steady: 9.7}
    assert ask(tuning.Tuner(timer=table_timer()), (fast, steady), balanced) == fast
    assert ask(tuning.Tuner(timer=table_timer()), (fast, steady), balanced, skewed, kind="k2") == steady


def test_with_a_peer_a_config_as_fast_on_each_routing_is_preferred_and_the_peer_is_a_candidate():
    peer, fast, safe = "torch", "fast", "safe"
    balanced = {fast: 3.52, safe: 3.36, peer: 3.49}
    skewed = {fast: 4.15, safe: 4.45, peer: 4.70}
    tuner = tuning.Tuner(timer=table_timer())
    assert ask(tuner, (peer, fast, safe), balanced, skewed, peer=peer) == safe
    assert tuner.decisions[-1].rule == "as fast as the peer on each routing"
    assert ask(tuning.Tuner(timer=table_timer()), (fast, safe), balanced, skewed, kind="k2") == fast  # no peer
    balanced[safe] = 3.60  # nothing as fast as torch on each routing: the sum, and fast beats torch on it
    tuner = tuning.Tuner(timer=table_timer())
    assert ask(tuner, (peer, fast, safe), balanced, skewed, peer=peer, kind="k3") == fast
    assert tuner.decisions[-1].rule.startswith("fastest on the sum (none")
    balanced[peer], skewed[peer] = 1.0, 1.0  # torch fastest: torch runs
    assert ask(tuning.Tuner(timer=table_timer()), (peer, fast, safe), balanced, skewed, peer=peer, kind="k4") == peer


def test_the_best_safe_candidate_joins_the_long_pass_from_outside_the_finalists():
    # u1-u3 lead on the sum but lose to torch on the skewed routing; s is behind them, yet as fast as torch on both
    timed = []
    balanced = {"u1": 3.0, "u2": 3.01, "u3": 3.02, "s": 3.39, "torch": 3.40}
    skewed = {"u1": 4.8, "u2": 4.8, "u3": 4.8, "s": 4.69, "torch": 4.70}

    def run(c):
        timed.append(c)
        return balanced[c]

    tuner = tuning.Tuner(timer=table_timer())
    with tuning.use(tuner):
        got = tuning.choose("k", X, 3, 4, 8, 2, ("torch", "u1", "u2", "u3", "s"), (run, lambda c: skewed[c]),
                            peer="torch")
    assert got == "s"
    assert timed.count("s") == timed.count("torch") == protocol.ROUNDS + protocol.FINAL_ROUNDS


def test_one_candidate_is_never_timed_and_nothing_is_cached(tmp_path):
    def timer(run, reps):
        raise AssertionError("a single candidate must not be timed")

    tuner = tuning.Tuner(timer=timer, cache_file=tmp_path / "t.json")
    assert ask(tuner, ("torch",), {}) == "torch" and not (tmp_path / "t.json").exists()


def test_failing_candidates_are_dropped_with_a_warning_and_all_failing_uses_the_fallback_or_raises():
    def run(c):
        if c != "ok":
            raise RuntimeError("no kernel")
        return 1.0

    tuner = tuning.Tuner(timer=lambda r, reps: r())
    with tuning.use(tuner), pytest.warns(RuntimeWarning, match="1 candidate.*failed"):
        assert tuning.choose("k", X, 3, 4, 8, 2, ("bad", "ok"), (run,)) == "ok"
    with tuning.use(tuner), pytest.warns(RuntimeWarning):
        assert tuning.choose("k2", X, 3, 4, 8, 2, ("bad", "worse"), (run,), fallback="bad") == "bad"
    with tuning.use(tuner), pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no candidate ran"):
        tuning.choose("k3", X, 3, 4, 8, 2, ("bad", "worse"), (run,))


def test_a_config_that_does_not_fit_the_gpu_is_dropped_quietly():
    import warnings

    class OutOfResources(Exception):
        pass

    def run(c):
        if c == "huge":
            raise OutOfResources("shared memory")
        return 1.0

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tuning.use(tuning.Tuner(timer=lambda r, reps: r())):
            assert tuning.choose("k", X, 3, 4, 8, 2, ("huge", "ok"), (run,)) == "ok"


def test_nothing_is_timed_during_graph_capture_and_the_placeholder_is_not_remembered(monkeypatch):
    from moetrain.tuning import tuner as tuner_module

    capturing = [True]
    monkeypatch.setattr(tuner_module, "_capturing", lambda: capturing[0])
    calls = []
    tuner = tuning.Tuner(timer=table_timer(calls))
    assert ask(tuner, ("first", "fast"), {"first": 2.0, "fast": 1.0}) == "first" and calls == []
    capturing[0] = False
    assert ask(tuner, ("first", "fast"), {"first": 2.0, "fast": 1.0}) == "fast"
    capturing[0] = True
    assert ask(tuner, ("first", "fast"), {"first": 2.0, "fast": 1.0}) == "fast"  # measured: the memo answers


def test_corrupt_cache_is_ignored_with_one_warning_and_another_version_quietly(tmp_path):
    import warnings

    path = tmp_path / "t.json"
    path.write_text('{"version": 1, "entries": {')
    with pytest.warns(RuntimeWarning, match="ignoring unreadable tuning cache") as record:
        assert ask(tuning.Tuner(timer=table_timer(), cache_file=path), ("a", "b"), {"a": 1.0, "b": 2.0}) == "a"
    assert len(record) == 1 and json.loads(path.read_text())["version"] == cache.VERSION
    key = next(iter(json.loads(path.read_text())["entries"]))
    path.write_text(json.dumps({"version": cache.VERSION + 1, "entries": {key: {"choice": "b", "ms": {}}}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ask(tuning.Tuner(timer=table_timer(), cache_file=path), ("a", "b"), {"a": 1.0, "b": 2.0}) == "a"


def test_the_default_cache_file_follows_moetrain_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE_DIR", str(tmp_path))
    tuner = tuning.Tuner(timer=table_timer())
    ask(tuner, ("a", "b"), {"a": 1.0, "b": 2.0})
    assert (tmp_path / cache.FILE).exists() and tuner.cache.path == tmp_path / cache.FILE


def test_decision_summary_names_the_pick_torch_and_how_many_ran():
    d = tuning.Decision("k", "cfg", "rule", {"torch": [2.6534, 3.0], "cfg": [1.0, 2.0], "bad": None})
    assert d.summary() == "cfg 1.000/2.000, torch 2.653/3.000 ms; 2 of 3 candidates ran"


def test_triton_available_asks_the_import_system_until_triton_is_imported(monkeypatch):
    import importlib.util
    import sys

    from moetrain.runtime.packages import triton_available

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert triton_available() is False
    monkeypatch.setitem(sys.modules, "triton", object())
    assert triton_available() is True


def test_cpu_auto_grouped_gemm_is_the_reference_and_asks_no_question():
    from moetrain import ops

    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    tuner = tuning.Tuner(timer=lambda r, reps: pytest.fail("nothing is timed on CPU"))
    with tuning.use(tuner):
        got = ops.grouped_gemm(x, w, offs, backend="auto")
    torch.testing.assert_close(got, ops.grouped_gemm(x, w, offs, backend="loop"))
    assert tuner.decisions == []


def test_a_measurement_inside_an_activation_checkpoint_is_made_once():
    # selective recompute checkpoints the expert path: the tuner's timing runs inside the checkpoint's forward and
    # must not disturb it; the recompute finds the memo
    g = torch.Generator().manual_seed(3)
    x0, w0 = torch.randn(12, 8, generator=g), torch.randn(3, 8, 8, generator=g)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    from moetrain.ops.grouped_gemm import grouped_gemm_loop

    def gemm(x, w):
        def run(c):
            grouped_gemm_loop(x.detach(), w.detach(), offs)
            return {"a": 1.0, "b": 2.0}[c]
        tuning.choose("k", x, 8, 8, 12, 3, ("a", "b"), (run,))
        return grouped_gemm_loop(x, w, offs).tanh()

    tuner = tuning.Tuner(timer=lambda r, reps: r())
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with tuning.use(tuner):
        y = torch.utils.checkpoint.checkpoint(gemm, x, w, use_reentrant=False)
        y.sum().backward()
    ref_x, ref_w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    grouped_gemm_loop(ref_x, ref_w, offs).tanh().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)
    assert len(tuner.decisions) == 1
