"""train.cuda_graph: config checks and refusals on the CPU; on a GPU (marked gpu) the graphed trainer against
the eager one (same seed: same losses within bf16 noise; faster on the host-bound tiny preset)."""

import statistics

import pytest
import torch

from moetrain.config.load import load_config
from moetrain.config.schema import ConfigError
from moetrain.errors import UserError


@pytest.mark.parametrize("override,named", [
    ("train.recompute=selective", "train.recompute=selective"),
    ("train.recompute_layer_ids=[1]", "train.recompute_layer_ids"),
    ("train.compile=true", "train.compile"),
    ("moe.backend=reference", "moe.backend=reference"),
])
def test_config_refuses_what_a_graph_cannot_hold(override, named):
    with pytest.raises(ConfigError, match=f"train.cuda_graph does not combine with {named}"):
        load_config(overrides=["train.cuda_graph=true", override])


def test_config_accepts_the_fused_and_torch_expert_paths():
    for backend in ("auto", "triton", "torch"):
        assert load_config(overrides=["train.cuda_graph=true", f"moe.backend={backend}"]).train.cuda_graph


def test_trainer_refuses_a_graph_on_the_cpu(tmp_path):
    from moetrain.train.trainer import run

    cfg = load_config(overrides=["train.cuda_graph=true", "train.device=cpu", f"train.out_dir={tmp_path}", "train.steps=1"])
    with pytest.raises(UserError, match="train.cuda_graph needs a CUDA device"):
        run(cfg, show_progress=False)


def test_accumulation_needs_main_grads_for_every_parameter():
    from moetrain.train.graphed_step import GraphedStep

    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(UserError, match="needs separate main grads for every parameter"):
        GraphedStep(None, [p], [False], 2, 1, 8, torch.device("cpu"), reset=lambda: None)


def _train(tmp_path, name, *overrides):
    from moetrain.train.trainer import run

    cfg = load_config(overrides=[f"train.out_dir={tmp_path / name}", "train.device=cuda", "train.steps=10",
                                 "checkpoint.save_final=false", *overrides])
    return run(cfg, show_progress=False).records


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [
    [],  # fp32 main grads: the captured hooks accumulate
    ["train.micro_batch_size=4", "train.global_batch_size=8"],  # two micro-batches per step
    ["optim.main_grads_dtype=bf16", "precision.master_weights=false"],  # no main grads: replays write param.grad
])
def test_graphed_steps_match_eager_ones(tmp_path, extra):
    eager = _train(tmp_path, "eager", *extra)
    graphed = _train(tmp_path, "graphed", "train.cuda_graph=true", *extra)
    assert [r["loss"] for r in graphed] == pytest.approx([r["loss"] for r in eager], rel=2e-3)
    assert [r["grad_norm"] for r in graphed] == pytest.approx([r["grad_norm"] for r in eager], rel=2e-2)
    if not extra:  # the tiny preset's step is host-bound eagerly: replays take the host out of it
        t_eager = statistics.median(r["step_time_s"] for r in eager[4:])
        t_graph = statistics.median(r["step_time_s"] for r in graphed[4:])
        print(f"tiny step: eager {t_eager * 1e3:.1f} ms, graphed {t_graph * 1e3:.1f} ms")
        assert t_graph < 0.6 * t_eager


@pytest.mark.gpu
def test_measure_times_graph_replays_for_cuda_graph_configs():
    from moetrain.plan.measure import measure_blocks

    common = ["train.seq_length=512", "train.micro_batch_size=16", "train.global_batch_size=16"]
    eager = measure_blocks(load_config(overrides=common))
    graphed = measure_blocks(load_config(overrides=common + ["train.cuda_graph=true"]))
    assert set(graphed) == set(eager) and all(f > 0 and b > 0 for f, b in graphed.values())
    # the tiny preset's blocks wait on the host when eager
    assert sum(map(sum, graphed.values())) < 0.5 * sum(map(sum, eager.values()))


def test_trainer_hands_micro_batches_to_the_graph_after_the_warmup_steps(tmp_path, monkeypatch):
    """The trainer's side of train.cuda_graph on the CPU: a stand-in for GraphedStep that runs the same forward +
    backward eagerly. From step WARMUP_STEPS + 1 on every micro-batch goes through it, and the losses are the eager
    run's."""
    from moetrain.train import graphed_step
    from moetrain.train.trainer import run

    calls = []

    class EagerStandIn:
        def __init__(self, model, params, has_main_grad, accum, micro_batch_size, seq_length, device, reset):
            self.model, self.accum = model, accum

        def run(self, input_ids, labels):
            calls.append(tuple(input_ids.shape))
            return graphed_step.forward_backward(self.model, input_ids, labels, self.accum)

    common = ["train.device=cpu", "train.steps=5", "train.micro_batch_size=2", "train.global_batch_size=4",
              "train.seq_length=16", "checkpoint.save_final=false"]
    eager = run(load_config(overrides=[f"train.out_dir={tmp_path / 'e'}", *common]), show_progress=False).records
    monkeypatch.setattr(graphed_step, "GraphedStep", EagerStandIn)
    graphed = run(load_config(overrides=[f"train.out_dir={tmp_path / 'g'}", "train.cuda_graph=true", *common]),
                  show_progress=False).records
    assert calls == [(2, 16)] * 2 * (5 - graphed_step.WARMUP_STEPS)  # two micro-batches per step
    assert [r["loss"] for r in graphed] == [r["loss"] for r in eager]
    assert [r["grad_norm"] for r in graphed] == [r["grad_norm"] for r in eager]
