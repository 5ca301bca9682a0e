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


@pytest.mark.parametrize("override", ["optim.exp_avg_dtype=bf16", "optim.main_grads_dtype=bf16",
                                      "precision.master_weights=false"])
def test_mixed_precision_optimizer_state_needs_the_triton_kernel(override):
    """torch's fused AdamW (the captured update with optim.triton_kernel=false) takes one dtype; the Triton AdamW
    kernel (the default) captures any dtype combination (without triton the graph refuses it when built)."""
    with pytest.raises(ConfigError, match=r"in one dtype; .* differ: set them to \w+, set optim.triton_kernel=true"):
        load_config(overrides=["train.cuda_graph=true", override, "optim.triton_kernel=false"])
    assert load_config(overrides=["train.cuda_graph=true", override]).train.cuda_graph


def test_config_accepts_the_fused_and_torch_expert_paths():
    for backend in ("auto", "triton", "torch"):
        assert load_config(overrides=["train.cuda_graph=true", f"moe.backend={backend}"]).train.cuda_graph


def test_trainer_refuses_a_graph_on_the_cpu(tmp_path):
    from moetrain.train.trainer import run

    cfg = load_config(overrides=["train.cuda_graph=true", "train.device=cpu", f"train.out_dir={tmp_path}", "train.steps=1"])
    with pytest.raises(UserError, match="train.cuda_graph needs a CUDA device"):
        run(cfg, show_progress=False)


def _optimizer(*overrides):
    from moetrain.models import build_model
    from moetrain.train.optim import PrecisionAwareAdamW

    cfg = load_config(overrides=["train.device=cpu", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg)
    return model, PrecisionAwareAdamW(model.named_parameters(), cfg.optim, cfg.precision.master_weights)


def test_accumulation_needs_main_grads_for_every_parameter():
    from moetrain.train.graphed_step import GraphedStep

    model, opt = _optimizer("optim.main_grads_dtype=fp32")
    opt.slots[0].main_grad = None  # one parameter without a main grad
    with pytest.raises(UserError, match="needs separate main grads for every parameter"):
        GraphedStep(model, opt, 2, 1, 8, torch.device("cpu"), 1.0, None)


def test_graph_refuses_mixed_precision_optimizer_state_without_the_kernel():
    from moetrain.train.graphed_step import GraphedStep

    model, opt = _optimizer("optim.exp_avg_dtype=bf16")  # fp32 master weights, bf16 first moment; CPU: no kernel
    with pytest.raises(UserError, match="mixed-precision optimizer state needs the Triton AdamW kernel"):
        GraphedStep(model, opt, 1, 1, 8, torch.device("cpu"), 1.0, None)
    opt.kernel = True  # where the kernel takes every parameter, only the device is left to refuse
    with pytest.raises(UserError, match="train.cuda_graph needs a CUDA device"):
        GraphedStep(model, opt, 1, 1, 8, torch.device("cpu"), 1.0, None)


def _fill_grads(opt, seed):
    gen = torch.Generator().manual_seed(seed)
    for s in opt.slots:
        g = torch.randn(s.param.shape, generator=gen) * 0.1
        if s.main_grad is not None:
            s.main_grad.copy_(g)
        else:
            s.param.grad = g.to(s.param.dtype)


@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6])
def test_step_on_device_matches_the_eager_clip_and_step(clip):
    _, eager = _optimizer()
    _, device = _optimizer()
    for step in range(3):
        for opt in (eager, device):
            _fill_grads(opt, step)
        norm = eager.grad_norm()
        if clip > 0 and norm.item() > clip:
            eager.scale_grads(clip / (norm.item() + 1e-6))
        eager.step(1e-3)
        device.step_on_device(torch.tensor(1e-3), device.grad_norm(), torch.tensor(1.0), clip)
        device.count_step()
    assert device.step_count == eager.step_count == 3
    moved = 0
    for a, b in zip(eager.slots, device.slots):
        torch.testing.assert_close(b.param, a.param, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(b.exp_avg_sq, a.exp_avg_sq, rtol=1e-5, atol=1e-12)
        moved += int(a.exp_avg.abs().sum() > 0)
    assert moved == len(eager.slots)


def test_step_on_device_skips_when_told():
    _, opt = _optimizer()
    _fill_grads(opt, 0)
    before = [(s.exp_avg.clone(), s.exp_avg_sq.clone(), s.param.detach().clone()) for s in opt.slots]
    counter = opt.device_step_counter(torch.device("cpu")).clone()
    opt.step_on_device(torch.tensor(1e-3), opt.grad_norm(), torch.tensor(0.0), 1.0)
    assert torch.equal(opt.device_step_counter(torch.device("cpu")), counter)
    for s, (avg, avg_sq, param) in zip(opt.slots, before):
        assert torch.equal(s.exp_avg, avg) and torch.equal(s.exp_avg_sq, avg_sq) and torch.equal(s.param, param)


def _train(tmp_path, name, *overrides):
    from moetrain.train.trainer import run

    cfg = load_config(overrides=[f"train.out_dir={tmp_path / name}", "train.device=cuda", "train.steps=10",
                                 "checkpoint.save_final=false", *overrides])
    return run(cfg, show_progress=False).records


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [
    [],  # fp32 main grads: the captured hooks accumulate
    ["train.micro_batch_size=4", "train.global_batch_size=8"],  # two micro-batches per step
    # no main grads (replays write param.grad), bf16 moments: every dtype one
    ["optim.main_grads_dtype=bf16", "precision.master_weights=false", "optim.exp_avg_dtype=bf16",
     "optim.exp_avg_sq_dtype=bf16"],
    # mixed-precision state: fp32 master weights and main grads, bf16 moments (the Triton AdamW kernel captured)
    ["optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16", "optim.triton_kernel=true"],
    # FP8 experts: the replays quantize the weights the captured optimizer step moved (no copy from capture time)
    ["precision.fp8_recipe=rowwise", "train.micro_batch_size=4", "train.global_batch_size=8"],
    ["precision.fp8_recipe=blockwise"],
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


@pytest.mark.parametrize("clip", ["1.0", "0.01"])  # 0.01: every step clipped
def test_trainer_hands_steps_to_the_graphs_after_the_warmup_steps(tmp_path, monkeypatch, clip):
    """The trainer's side of train.cuda_graph on the CPU: GraphedStep with the graphs replaced by direct calls of
    what they capture (the micro-batch, the step tail with the update on the device). From step WARMUP_STEPS + 1
    every micro-batch and step goes through it, and losses and norms are the eager run's."""
    from moetrain.train import graphed_step
    from moetrain.train.trainer import run

    calls = []

    class EagerStandIn(graphed_step.GraphedStep):
        @staticmethod
        def _require_cuda(device):
            pass

        def _launch(self, name, fn):
            calls.append(name)
            fn()

    # one micro-batch a step: on the CPU the model is fp32, so its gradients are the parameters' own (no main
    # grads), which a graph cannot accumulate (the GPU test runs two micro-batches with fp32 main grads)
    common = ["train.device=cpu", "train.steps=5", "train.micro_batch_size=2", "train.global_batch_size=2",
              "train.seq_length=16", "checkpoint.save_final=false", f"optim.clip_grad={clip}"]
    eager = run(load_config(overrides=[f"train.out_dir={tmp_path / 'e'}", *common]), show_progress=False).records
    monkeypatch.setattr(graphed_step, "GraphedStep", EagerStandIn)
    graphed = run(load_config(overrides=[f"train.out_dir={tmp_path / 'g'}", "train.cuda_graph=true", *common]),
                  show_progress=False).records
    assert calls == ["micro_batch", "tail"] * (5 - graphed_step.WARMUP_STEPS)
    assert [r["loss"] for r in graphed] == pytest.approx([r["loss"] for r in eager], rel=1e-5)
    assert [r["grad_norm"] for r in graphed] == pytest.approx([r["grad_norm"] for r in eager], rel=1e-4)
    assert [r["load_imbalance"] for r in graphed] == [r["load_imbalance"] for r in eager]
