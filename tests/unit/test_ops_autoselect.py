"""backend="auto": the per-shape decision and its disk cache, on CPU with an injected fake timer."""

import json

import pytest
import torch

from moetrain import ops
from moetrain.kernels.host import rows_bucket
from moetrain.ops import autoselect

KEY = autoselect.cache_key("grouped_gemm_fwd", torch.bfloat16, 1536, 2048, 131072, 128, "NVIDIA H200")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autoselect, "ROUNDS", 1)  # one timing per candidate (the rounds have their own test)
    autoselect.reset()
    yield tmp_path
    autoselect.reset()


class FakeTimer:
    """time_backend stand-in: fixed milliseconds per backend; records what was timed and runs it once."""

    def __init__(self, ms):
        self.ms, self.calls = ms, []

    def __call__(self, backend, run):
        self.calls.append(backend)
        run()
        return self.ms[backend]


def install(monkeypatch, ms, triton=True):
    timer = FakeTimer(ms)
    monkeypatch.setattr(autoselect, "time_backend", timer)
    monkeypatch.setattr(autoselect, "triton_available", lambda: triton)
    return timer


def test_bucket_boundaries():
    assert [rows_bucket(r * 8, 8) for r in (1, 2, 3, 4, 5, 64, 65, 128, 129)] == [1, 2, 4, 4, 8, 64, 128, 128, 256]
    assert rows_bucket(0, 8) == rows_bucket(5, 8) == 1  # fewer rows than groups
    key = lambda rows: autoselect.cache_key("grouped_gemm_fwd", torch.bfloat16, 1536, 2048, rows, 128, "H200")  # noqa: E731
    assert key(65 * 128) == key(128 * 128) != key(64 * 128)
    assert key(128 * 128) != key(129 * 128)
    assert key(1024) != autoselect.cache_key("grouped_gemm_fwd", torch.float16, 1536, 2048, 1024, 128, "H200")
    assert key(1024) != autoselect.cache_key("grouped_gemm_fwd", torch.bfloat16, 1536, 2048, 1024, 128, "H100")
    assert key(1024) != autoselect.cache_key("grouped_gemm", torch.bfloat16, 1536, 2048, 1024, 128, "H200")


def test_miss_measures_records_and_hits(monkeypatch, cache_dir):
    ran = []
    timer = install(monkeypatch, {"torch": 2.0, "triton": 1.5})
    assert autoselect.pick(KEY, ran.append) == "triton"
    assert timer.calls == ["torch", "triton"] and ran == ["torch", "triton"]
    data = json.loads((cache_dir / autoselect.CACHE_FILE).read_text())
    assert data["entries"][KEY] == {"backend": "triton", "ms": {"torch": 2.0, "triton": 1.5}}
    # Hit in memory, then (new process) from the file: nothing is timed again.
    assert autoselect.pick(KEY, ran.append) == "triton"
    autoselect.reset()
    assert autoselect.pick(KEY, ran.append) == "triton"
    assert timer.calls == ["torch", "triton"]
    # Another shape is a miss and is added next to the first entry.
    other = KEY.replace("|N1536|", "|N4096|")
    timer.ms = {"torch": 1.0, "triton": 3.0}
    assert autoselect.pick(other, ran.append) == "torch"
    assert set(json.loads((cache_dir / autoselect.CACHE_FILE).read_text())["entries"]) == {KEY, other}


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(monkeypatch, cache_dir):
    path = cache_dir / autoselect.CACHE_FILE
    path.write_text('{"version": 1, "entries": {')
    install(monkeypatch, {"torch": 1.0, "triton": 2.0})
    with pytest.warns(RuntimeWarning, match="ignoring unreadable backend cache") as record:
        assert autoselect.pick(KEY, lambda name: None) == "torch"
    assert len(record) == 1
    assert json.loads(path.read_text())["entries"][KEY]["backend"] == "torch"
    assert not [p for p in cache_dir.iterdir() if p.name != autoselect.CACHE_FILE]  # no temp file left


def test_triton_missing_only_torch_is_timed(monkeypatch):
    timer = install(monkeypatch, {"torch": 5.0, "triton": 0.1}, triton=False)
    assert autoselect.pick(KEY, lambda name: None) == "torch"
    assert timer.calls == []  # torch is the only candidate left: nothing to compare


def test_failing_backend_is_skipped_and_all_failing_falls_back_to_loop(monkeypatch):
    install(monkeypatch, {"torch": 1.0, "triton": 0.5})

    def run(name):
        if name == "triton":
            raise RuntimeError("out of shared memory")

    with pytest.warns(RuntimeWarning, match="backend triton failed"):
        assert autoselect.pick(KEY, run) == "torch"

    def fail(name):
        raise RuntimeError("no kernel")

    with pytest.warns(RuntimeWarning):
        assert autoselect.pick(KEY.replace("|K2048|", "|K7|"), fail) == "loop"


def test_no_timing_during_graph_capture(monkeypatch, cache_dir):
    timer = install(monkeypatch, {"torch": 2.0, "triton": 1.0})
    assert autoselect.pick(KEY, lambda name: None, capturing=True) == "torch"
    assert timer.calls == [] and not (cache_dir / autoselect.CACHE_FILE).exists()
    autoselect.pick(KEY, lambda name: None)  # warm-up outside capture records triton
    assert autoselect.pick(KEY, lambda name: None, capturing=True) == "triton"


def test_cpu_auto_stays_loop_and_never_times(monkeypatch):
    timer = install(monkeypatch, {"torch": 2.0, "triton": 1.0})
    x = torch.randn(6, 4)
    assert autoselect.choose("grouped_gemm", x, 3, 4, 6, 2, lambda name: None) == "loop"
    w = torch.randn(2, 3, 4)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    torch.testing.assert_close(ops.grouped_gemm(x, w, offs, backend="auto"), ops.grouped_gemm(x, w, offs, backend="loop"))
    assert timer.calls == []


def test_choose_builds_the_key_and_runs_the_real_op(monkeypatch, cache_dir):
    # Pretend this CPU is a measured device: the torch backend really runs (forward + backward) under
    # the fake timer, and the auto choice then computes the same numbers as the reference.
    monkeypatch.setattr(autoselect, "measures", lambda device: True)
    monkeypatch.setattr(autoselect, "device_name", lambda device: "FakeGPU")
    timer = install(monkeypatch, {"torch": 1.0, "loop": 2.0}, triton=False)  # triton's run: test_moe_fused.py
    # the reference joins as a second candidate so that the measuring path runs on CPU
    monkeypatch.setattr(autoselect, "GPU_VALIDATED", {"grouped_gemm_fwd": ("torch", "loop")})
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 8, generator=g), torch.randn(3, 8, 8, generator=g)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)  # no empty group: torch's CPU backward needs that
    got = ops.grouped_gemm(x, w, offs, backend="auto")
    torch.testing.assert_close(got, ops.grouped_gemm(x, w, offs, backend="loop"))
    assert timer.calls == ["torch", "loop"]
    entries = json.loads((cache_dir / autoselect.CACHE_FILE).read_text())["entries"]
    assert entries == {autoselect.cache_key("grouped_gemm_fwd", torch.float32, 8, 8, 10, 3, "FakeGPU"):
                       {"backend": "torch", "ms": {"torch": 1.0, "loop": 2.0}}}


def test_measurement_inside_an_activation_checkpoint(monkeypatch):
    # The layer's selective recompute checkpoints the expert path: auto's measurements then run inside
    # the checkpoint's forward (and backward) and must not disturb it; the recompute finds the cache.
    monkeypatch.setattr(autoselect, "measures", lambda device: True)
    monkeypatch.setattr(autoselect, "device_name", lambda device: "FakeGPU")
    timer = install(monkeypatch, {"torch": 1.0, "loop": 2.0}, triton=False)
    kinds = ("grouped_gemm_fwd", "grouped_gemm_dgrad", "grouped_gemm_wgrad")
    monkeypatch.setattr(autoselect, "GPU_VALIDATED", {kind: ("torch", "loop") for kind in kinds})
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(12, 8, generator=g), torch.randn(3, 8, 8, generator=g)]
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)  # no empty group: torch's CPU backward needs that
    grads = {}
    for backend in ("auto", "loop"):
        leaves = [t.clone().requires_grad_() for t in tensors]
        fn = lambda x, w: ops.grouped_gemm(x, w, offs, backend=backend).tanh()  # noqa: E731
        y = torch.utils.checkpoint.checkpoint(fn, *leaves, use_reentrant=False)
        y.backward(torch.ones_like(y))
        grads[backend] = [y.detach()] + [t.grad for t in leaves]
    for a, b in zip(grads["auto"], grads["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert timer.calls == ["torch", "loop"] * 3  # fwd, dgrad, wgrad once each; the recompute used the cache


def test_auto_only_chooses_gpu_validated_backends(monkeypatch):
    """A single GPU-validated candidate is used without timing or caching anything."""
    monkeypatch.setattr(autoselect, "triton_available", lambda: True)
    monkeypatch.setattr(autoselect, "GPU_VALIDATED", {"grouped_gemm_fwd": ("torch",)})

    def timer(name, run):
        raise AssertionError("a single candidate must not be timed")

    monkeypatch.setattr(autoselect, "time_backend", timer)
    key = autoselect.cache_key("grouped_gemm_fwd", torch.bfloat16, 1536, 2048, 131072, 128, "NVIDIA H200")
    assert autoselect.pick(key, lambda name: None) == "torch"
    assert not autoselect.cache_path().exists()  # nothing measured, nothing cached


def test_forward_dgrad_and_wgrad_each_take_their_own_backend(monkeypatch, cache_dir):
    """auto on a (fake) GPU: each of the three GEMMs is measured on its own and may pick another backend;
    the results equal the reference whatever the mix."""
    monkeypatch.setattr(autoselect, "measures", lambda device: True)
    monkeypatch.setattr(autoselect, "device_name", lambda device: "FakeGPU")
    kinds = ("grouped_gemm_fwd", "grouped_gemm_dgrad", "grouped_gemm_wgrad")
    monkeypatch.setattr(autoselect, "GPU_VALIDATED", {kind: ("torch", "loop") for kind in kinds})
    winners = {"grouped_gemm_fwd": "loop", "grouped_gemm_dgrad": "torch", "grouped_gemm_wgrad": "loop"}
    timed = []

    def timer(backend, run):
        kind = current_kind[0]
        timed.append((kind, backend))
        run()
        return 1.0 if backend == winners[kind] else 2.0

    current_kind = [None]
    real_choose = autoselect.choose

    def choose(kind, *args):
        current_kind[0] = kind
        return real_choose(kind, *args)

    monkeypatch.setattr(autoselect, "time_backend", timer)
    monkeypatch.setattr(autoselect, "choose", choose)
    monkeypatch.setattr(autoselect, "triton_available", lambda: False)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(12, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)  # an empty group; 16-byte strides for torch on CPU
    probe = torch.randn(12, 8, generator=g)
    results = {}
    for backend in ("auto", "loop"):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = ops.grouped_gemm(xl, wl, offs, backend=backend)
        (y * probe).sum().backward()
        results[backend] = (y.detach(), xl.grad, wl.grad)
    for a, b in zip(results["auto"], results["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert [k for k, _ in timed] == [k for k in kinds for _ in range(2)]  # each op measured once, both backends
    entries = json.loads((cache_dir / autoselect.CACHE_FILE).read_text())["entries"]
    assert {key.split("|")[0]: e["backend"] for key, e in entries.items()} == winners


def test_candidates_are_timed_in_turns_and_compared_by_median(monkeypatch, cache_dir):
    """Timed back to back, a later candidate runs on a hotter GPU: auto times A, B, A, B, ... and takes
    each candidate's median, so one slow round (here triton's second) does not decide."""
    monkeypatch.setattr(autoselect, "ROUNDS", 3)
    monkeypatch.setattr(autoselect, "triton_available", lambda: True)
    ms = {"torch": iter([2.0, 2.1, 1.9]), "triton": iter([1.5, 9.0, 1.6])}
    calls = []

    def turns(backend, run):
        calls.append(backend)
        return next(ms[backend])

    monkeypatch.setattr(autoselect, "time_backend", turns)
    assert autoselect.pick(KEY, lambda name: None) == "triton"
    assert calls == ["torch", "triton", "torch", "triton", "triton", "torch"]  # the last round starts at triton
    entry = json.loads((cache_dir / autoselect.CACHE_FILE).read_text())["entries"][KEY]
    assert entry["ms"] == {"torch": 2.0, "triton": 1.6}


def test_a_candidate_failing_in_a_later_round_is_dropped(monkeypatch, cache_dir):
    monkeypatch.setattr(autoselect, "ROUNDS", 2)
    monkeypatch.setattr(autoselect, "triton_available", lambda: True)
    seen = []

    def flaky(backend, run):
        seen.append(backend)
        if backend == "triton" and seen.count("triton") == 2:
            raise RuntimeError("out of resources")
        return 1.0 if backend == "triton" else 2.0

    monkeypatch.setattr(autoselect, "time_backend", flaky)
    with pytest.warns(RuntimeWarning, match="backend triton failed"):
        assert autoselect.pick(KEY, lambda name: None) == "torch"


def test_relabeled_tokens_keep_the_routing_and_move_its_tokens():
    # the fused path's gathers are also timed with the tokens relabeled: every row still reads the token that owns it
    from moetrain.runtime.timing import relabeled_tokens

    T, K = 64, 4
    row_map = torch.randperm(T * K, generator=torch.Generator().manual_seed(3))
    inverse = torch.empty_like(row_map)
    inverse[row_map] = torch.arange(T * K)
    token_of_row = (row_map // K).to(torch.int32)
    rows, inv = relabeled_tokens(token_of_row, inverse, K)
    assert rows.dtype == torch.int32 and inv.dtype == torch.int64 and inv.shape == inverse.shape
    assert torch.equal(rows[inv].long(), torch.arange(T * K) // K)  # token_of_row'[inverse'[t*K + k]] = t
    assert not torch.equal(rows, token_of_row)
    assert torch.equal(torch.bincount(rows.long(), minlength=T), torch.full((T,), K))  # K rows per token
    # the same relabel of each row's token: rows that shared a token still share one
    same = token_of_row.unsqueeze(0) == token_of_row.unsqueeze(1)
    assert torch.equal(same, rows.unsqueeze(0) == rows.unsqueeze(1))
    assert torch.equal(rows, relabeled_tokens(token_of_row, inverse, K)[0])  # fixed per seed


def test_on_both_times_the_callers_input_then_the_other_made_once():
    # the measurement closure of the grouped GEMMs (a skewed routing) and the fused path (relabeled tokens)
    made, calls = [], []
    run = autoselect.on_both(lambda name, v: calls.append((name, v)) or v, ("own",),
                             lambda: made.append(1) or ("other",))
    assert made == []  # nothing made until a candidate is timed (a cached answer needs none)
    assert run("a") == "other" and run("b") == "other"
    assert calls == [("a", "own"), ("a", "other"), ("b", "own"), ("b", "other")] and made == [1]


def test_skewed_offs_cover_every_row_unevenly():
    # the skewed routing auto times the grouped GEMMs on besides the caller's
    from moetrain.runtime.timing import skewed_offs

    offs = skewed_offs(4096, 32, 0, torch.device("cpu"))
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    assert offs.dtype == torch.int32 and offs.shape == (32,) and int(offs[-1]) == 4096
    assert bool((counts >= 0).all()) and int(counts.max()) > 3 * 4096 // 32
    assert torch.equal(offs, skewed_offs(4096, 32, 0, torch.device("cpu")))  # fixed per seed


def test_cache_of_another_version_is_measured_again_quietly(monkeypatch, cache_dir):
    # version 1 timed the grouped GEMMs on the caller's routing only: its choices are not reused
    import warnings

    path = cache_dir / autoselect.CACHE_FILE
    path.write_text(json.dumps({"version": autoselect.VERSION - 1, "entries": {KEY: {"backend": "triton", "ms": {}}}}))
    install(monkeypatch, {"torch": 1.0, "triton": 2.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autoselect.pick(KEY, lambda name: None) == "torch"
    assert json.loads(path.read_text())["version"] == autoselect.VERSION


def test_describe_times_names_each_candidate_and_failures():
    assert autoselect.describe_times({"torch": 2.6534, "triton": None}) == "torch 2.653, triton failed"


def test_triton_available_asks_the_import_system_until_triton_is_imported(monkeypatch):
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert autoselect.triton_available() is False
    monkeypatch.setitem(sys.modules, "triton", object())  # imported: no search
    assert autoselect.triton_available() is True


def test_choose_remembers_its_answer_without_rebuilding_the_key(monkeypatch, cache_dir):
    """The second call with the same arguments answers from choose's memo (no key string, no pick: ~20 us of host
    time per lookup on the H200's host); a placeholder answered during a CUDA-graph capture is not remembered."""
    monkeypatch.setattr(autoselect, "measures", lambda device: True)
    monkeypatch.setattr(autoselect, "device_name", lambda device: "FakeGPU")
    install(monkeypatch, {"torch": 2.0, "triton": 1.0})
    x = torch.randn(8, 4)
    capturing = [True]
    monkeypatch.setattr(autoselect, "capturing", lambda: capturing[0])
    assert autoselect.choose("grouped_gemm_fwd", x, 3, 4, 8, 2, lambda name: None) == "torch"  # the placeholder
    capturing[0] = False
    assert autoselect.choose("grouped_gemm_fwd", x, 3, 4, 8, 2, lambda name: None) == "triton"  # measured now
    picks = []
    monkeypatch.setattr(autoselect, "pick", lambda *a, **kw: picks.append(a) or "torch")
    monkeypatch.setattr(autoselect, "cache_key", lambda *a: pytest.fail("the memo must answer"))
    assert autoselect.choose("grouped_gemm_fwd", x, 3, 4, 8, 2, lambda name: None) == "triton"
    assert picks == []
    autoselect.reset()  # forgets the memo too
    assert not autoselect._chosen
