"""The training loop: learning, exact resume, skipping non-finite steps, Ctrl-C, checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moetrain.config.load import load_config
from moetrain.errors import UserError
from moetrain.train import checkpoint as ckpt
from moetrain.train.trainer import run

REPO = Path(__file__).resolve().parents[2]
REQUIRED = {"step", "loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu",
            "mfu", "peak_mem_gib", "load_imbalance"}


def small(tmp_path, *extra):
    """The tiny preset, shortened so each run takes a couple of seconds."""
    return load_config(overrides=[
        f"train.out_dir={tmp_path}", "train.steps=20", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.seq_length=32", "optim.warmup_steps=2", *extra])


def read_metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def test_resume_gives_identical_losses(tmp_path):
    """20 steps straight vs resuming from the step-10 checkpoint of the same run: identical losses."""
    straight = run(small(tmp_path, "checkpoint.interval=10"), show_progress=False)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_10", "step_20"]
    resumed = run(small(tmp_path, f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_10'}"), show_progress=False)
    assert [r["step"] for r in resumed.records] == list(range(11, 21))
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in straight.records[10:]]  # bit-identical
    assert [r["grad_norm"] for r in resumed.records] == [r["grad_norm"] for r in straight.records[10:]]
    # metrics.jsonl holds steps 1..20 once: the first 10 kept, the rest rewritten by the resumed run
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 21))


def test_resume_auto_continues_an_interrupted_run(tmp_path):
    first = run(small(tmp_path, "train.steps=6"), show_progress=False)
    assert first.last_step == 6
    resumed = run(small(tmp_path, "train.steps=8", "checkpoint.resume=auto"), show_progress=False)
    assert [r["step"] for r in resumed.records] == [7, 8]


def test_metrics_complete_and_grad_accumulation(tmp_path):
    result = run(small(tmp_path, "train.steps=3", "train.global_batch_size=8"), show_progress=False)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert REQUIRED <= set(record)
        assert record["mfu"] is None  # CPU: unknown peak, no MFU rather than a wrong one
        assert record["tokens_per_s"] > 0 and record["tflops_per_gpu"] > 0
        assert all(v >= 1.0 for v in record["load_imbalance"])  # max/mean tokens per expert
    assert result.records == records
    saved = ckpt.list_checkpoints(tmp_path)
    assert [p.name for p in saved] == ["step_3"]


def test_accumulation_equals_one_big_batch(tmp_path):
    """4 micro-batches of 2 and 1 micro-batch of 8 see the same sequences: same first-step loss and grad."""
    many = run(small(tmp_path / "a", "train.steps=1", "train.global_batch_size=8", "train.micro_batch_size=2",
                     "moe.force_balance=even"), show_progress=False)
    one = run(small(tmp_path / "b", "train.steps=1", "train.global_batch_size=8", "train.micro_batch_size=8",
                    "moe.force_balance=even"), show_progress=False)
    assert many.records[0]["loss"] == pytest.approx(one.records[0]["loss"], rel=1e-5)
    assert many.records[0]["grad_norm"] == pytest.approx(one.records[0]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("extra", [[], ["optim.exp_avg_dtype=bf16"]])  # update on the device; decided on the host
def test_non_finite_steps_are_skipped_then_abort(tmp_path, monkeypatch, extra):
    import moetrain.models as models

    real_build = models.build_model
    poisoned_calls = {"n": 0, "bad": set()}

    def build(cfg):
        model = real_build(cfg)
        forward = model.forward

        def poisoned(input_ids, labels=None):
            out = forward(input_ids, labels)
            poisoned_calls["n"] += 1
            if poisoned_calls["n"] in poisoned_calls["bad"]:
                out.loss = out.loss * float("nan")
            return out

        model.forward = poisoned
        return model

    monkeypatch.setattr(models, "build_model", build)
    poisoned_calls["bad"] = {3, 4}  # micro-batches of step 2 (2 per step)
    result = run(small(tmp_path / "a", "train.steps=4", *extra), show_progress=False)
    assert [r["skipped"] for r in result.records] == [False, True, False, False]
    poisoned_calls.update(n=0, bad=set(range(1, 100)))
    with pytest.raises(UserError, match="max_skipped_steps = 2"):
        run(small(tmp_path / "b", "train.steps=10", "train.max_skipped_steps=2", *extra), show_progress=False)


def test_multi_device_layout_is_refused(tmp_path):
    with pytest.raises(UserError, match="parallel.ep = 2"):
        run(small(tmp_path, "parallel.ep=2", "parallel.dp=2", "train.global_batch_size=4"), show_progress=False)


def test_recompute_and_precision_options_train_the_same(tmp_path):
    base = run(small(tmp_path / "a", "train.steps=3"), show_progress=False)
    full = run(small(tmp_path / "b", "train.steps=3", "train.recompute=full"), show_progress=False)
    ids = run(small(tmp_path / "c", "train.steps=3", "train.recompute_layer_ids=[0,2,4]"), show_progress=False)
    for other in (full, ids):
        assert [r["loss"] for r in other.records] == pytest.approx([r["loss"] for r in base.records], rel=1e-5)
    bf16_state = run(small(tmp_path / "d", "train.steps=3", "optim.exp_avg_dtype=bf16",
                           "optim.exp_avg_sq_dtype=bf16"), show_progress=False)
    assert bf16_state.records[1]["loss"] == pytest.approx(base.records[1]["loss"], rel=1e-2)


def test_sigint_saves_checkpoint_and_exits_cleanly(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetrain", "train", f"train.out_dir={tmp_path}", "train.steps=100000",
         "checkpoint.interval=0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    saved = ckpt.list_checkpoints(tmp_path)
    assert len(saved) == 1
    step = int(saved[0].name.split("_")[1])
    assert step == len(read_metrics(tmp_path)) >= 3


def test_default_train_command_learns(tmp_path):
    """`moetrain train` on the built-in tiny default: loss falls, metrics complete."""
    proc = subprocess.run([sys.executable, "-m", "moetrain", "train", f"train.out_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(tmp_path)
    cfg = load_config()
    assert len(records) == cfg.train.steps
    assert all(REQUIRED <= set(r) for r in records)
    first = sum(r["loss"] for r in records[:10]) / 10
    last = sum(r["loss"] for r in records[-10:]) / 10
    assert last < 0.7 * first, (first, last)
    assert ckpt.list_checkpoints(tmp_path)


def test_eval_profile_and_manual_gc(tmp_path):
    result = run(small(tmp_path, "train.steps=6", "train.eval_interval=3", "train.eval_steps=2",
                       "profile.enabled=true", "profile.start_step=2", "profile.end_step=3",
                       "train.manual_gc=true", "train.manual_gc_interval=2"), show_progress=False)
    evals = {r["step"]: r.get("eval_loss") for r in result.records}
    assert evals[1] is None and evals[2] is None
    assert evals[3] is not None and evals[6] is not None and evals[6] < evals[3]  # learning shows on held-out data
    traces = list((tmp_path / "profile").glob("trace_steps_2-3.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    assert any("aten::mm" in e.get("name", "") or "aten::addmm" in e.get("name", "") for e in trace["traceEvents"])
    import gc
    assert gc.isenabled()  # manual GC hands collection back to Python when training ends


def test_trains_on_a_prepared_token_dataset_via_cli(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(200)))
    data_dir = tmp_path / "data"
    prep = subprocess.run([sys.executable, "-m", "moetrain", "data", "prepare", "--input", str(corpus),
                           "--tokenizer", "bytes", "--output", str(data_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moetrain", "train", f"train.out_dir={out}", "train.steps=30",
           "data.source=tokens", f"data.path={data_dir}", "train.seq_length=32", "train.eval_interval=15"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(out)
    assert len(records) == 30 and records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "eval_loss" in records[14] and "eval_loss" in records[29]


def test_user_errors_are_one_line(tmp_path):
    cases = [
        (["data.source=tokens", f"data.path={tmp_path / 'missing'}"], str(tmp_path / "missing")),
        (["train.device=cuda"] if not torch.cuda.is_available() else ["parallel.tp=2"], "train"),
        (["parallel.tp=2", "model.num_attention_heads=4"], "parallel.tp = 2"),
    ]
    for overrides, needle in cases:
        proc = subprocess.run([sys.executable, "-m", "moetrain", "train", f"train.out_dir={tmp_path / 'o'}",
                               *overrides], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (overrides, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_tensorboard_scalars_match_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run(small(tmp_path, "train.steps=3", "train.tensorboard=true"), show_progress=False)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert [s for s, _ in logged] == [1, 2, 3]
    assert [v for _, v in logged] == pytest.approx([r["loss"] for r in result.records], rel=1e-6)


@pytest.mark.parametrize("extra", [[], ["optim.main_grads_dtype=bf16"]])
def test_training_state_is_freed_after_run(tmp_path, monkeypatch, extra):
    """Gradient hooks must not keep the model and optimizer state alive after run() returns."""
    import gc
    import weakref

    import moetrain.train.optim as optim_mod

    refs = []
    original = optim_mod.PrecisionAwareAdamW.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for slot in self.slots:
            refs.extend(weakref.ref(t) for t in (slot.param, slot.exp_avg, slot.main_grad) if t is not None)

    monkeypatch.setattr(optim_mod.PrecisionAwareAdamW, "__init__", spy)
    run(small(tmp_path, "train.steps=2", *extra), show_progress=False)
    gc.collect()
    assert refs and sum(r() is not None for r in refs) == 0


def test_compiled_layers_train_exactly_like_eager_on_cpu(tmp_path):
    """train.compile=true (torch.compile of each decoder layer) keeps the numbers (CPU, fp32)."""
    eager = run(small(tmp_path / "e", "train.steps=3"), show_progress=False)
    compiled = run(small(tmp_path / "c", "train.steps=3", "train.compile=true"), show_progress=False)
    assert [r["loss"] for r in compiled.records] == pytest.approx([r["loss"] for r in eager.records], rel=1e-6)


# ---- the Trainer's step methods ----------------------------------------------------------------------------

def test_step_result_matches_a_direct_forward_backward(tmp_path):
    """The first StepResult against the model run by hand: same seed, the same two micro-batches, the mean of
    their loss terms and the norm of the accumulated gradients of loss / 2."""
    from moetrain.models import build_model
    from moetrain.train.data import build_data
    from moetrain.train.lr import lr_at
    from moetrain.train.trainer import Trainer

    cfg = small(tmp_path, "train.steps=1", "checkpoint.save_final=false")
    results = []

    class Recording(Trainer):
        def train_step(self, step):
            results.append(super().train_step(step))
            return results[-1]

    Recording(cfg, show_progress=False).run()
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    data = build_data(cfg, cfg.model.vocab_size, "train")
    terms = torch.zeros(4)
    for _ in range(2):
        out = model(*data.next_batch(2))
        (out.loss / 2).backward()
        terms += torch.stack([out.loss, out.lm_loss, out.aux_loss, out.mtp_loss]).detach() / 2
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    (got,) = results
    assert [got.loss, got.lm_loss, got.aux_loss, got.mtp_loss] == pytest.approx(terms.tolist(), rel=1e-6)
    assert got.grad_norm == pytest.approx(norm.item(), rel=1e-5)
    assert not got.skipped and got.tokens == 4 * 32 and got.lr == lr_at(0, cfg.optim, cfg.train.steps)
    assert len(got.load_imbalance) == len(model.moe_layers()) and all(v >= 1.0 for v in got.load_imbalance)


def test_the_loop_runs_a_subclass_forward_backward_step(tmp_path):
    """An override of forward_backward_step sees every micro-batch, and the step reports what it returns: loss
    terms doubled (exact in fp32) leave the gradients, so grad norms, as they were."""
    from moetrain.train.steps import LossTerms
    from moetrain.train.trainer import Trainer

    seen = []

    class Doubled(Trainer):
        def forward_backward_step(self, input_ids, labels):
            seen.append((tuple(input_ids.shape), input_ids.dtype))
            return LossTerms(super().forward_backward_step(input_ids, labels).values * 2)

    base = run(small(tmp_path / "a", "train.steps=3"), show_progress=False).records
    doubled = Doubled(small(tmp_path / "b", "train.steps=3"), show_progress=False).run().records
    assert seen == [((2, 32), torch.int64)] * 6  # 3 steps of 2 micro-batches
    assert [r["loss"] for r in doubled] == [2 * r["loss"] for r in base]
    assert [r["mtp_loss"] for r in doubled] == [2 * r["mtp_loss"] for r in base]
    assert [r["grad_norm"] for r in doubled] == [r["grad_norm"] for r in base]


def test_a_pipeline_shaped_forward_backward_trains_the_same(tmp_path):
    """forward_backward is the unit a pipeline schedule replaces: one that runs every micro-batch's forward and
    then every backward (GPipe's order) trains bit for bit like the default one forward + backward at a time."""
    from moetrain.train.steps import LossTerms
    from moetrain.train.trainer import Trainer

    order = []

    class AllForwardsThenAllBackwards(Trainer):
        def forward_backward(self, micro_batches):
            outs = []
            for input_ids, labels in list(micro_batches):
                order.append("F")
                outs.append(self.model(input_ids, labels))
            sums = torch.zeros(4)
            for out in outs:
                order.append("B")
                (out.loss / self.accum).backward()
                sums += torch.stack([out.loss, out.lm_loss, out.aux_loss, out.mtp_loss]).detach() / self.accum
            return LossTerms(sums)

    base = run(small(tmp_path / "a", "train.steps=3"), show_progress=False).records
    piped = AllForwardsThenAllBackwards(small(tmp_path / "b", "train.steps=3"), show_progress=False).run().records
    assert order == ["F", "F", "B", "B"] * 3
    for key in ("loss", "lm_loss", "aux_loss", "mtp_loss", "grad_norm", "load_imbalance"):
        assert [r[key] for r in piped] == [r[key] for r in base], key


def test_the_update_decided_on_the_host_matches_the_one_on_the_device(tmp_path):
    """The step strategy follows the optimizer: fused AdamW for every parameter -> DeviceUpdateStep, the explicit
    per-tensor path -> EagerStep; with every step clipped (clip 0.01) both train alike."""
    from moetrain.train.optim import PrecisionAwareAdamW
    from moetrain.train.steps import DeviceUpdateStep, EagerStep
    from moetrain.train.trainer import Trainer

    class Watched(Trainer):
        def train_step(self, step):
            self.modes_seen = getattr(self, "modes_seen", set()) | {type(self.step_mode(step))}
            return super().train_step(step)

    class Explicit(Watched):
        def build_optimizer(self):
            return PrecisionAwareAdamW(self.model.named_parameters(), self.cfg.optim, self.cfg.precision.master_weights,
                                       fused=False)

    on_device = Watched(small(tmp_path / "d", "train.steps=4", "optim.clip_grad=0.01"), show_progress=False)
    on_host = Explicit(small(tmp_path / "h", "train.steps=4", "optim.clip_grad=0.01"), show_progress=False)
    device, host = on_device.run().records, on_host.run().records
    assert on_device.modes_seen == {DeviceUpdateStep} and on_host.modes_seen == {EagerStep}
    assert all(r["grad_norm"] > 0.01 for r in device)  # every step clipped
    assert [r["loss"] for r in host] == pytest.approx([r["loss"] for r in device], rel=1e-5)
    assert [r["grad_norm"] for r in host] == pytest.approx([r["grad_norm"] for r in device], rel=1e-4)
