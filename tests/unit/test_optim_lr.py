"""PrecisionAwareAdamW against torch.optim.AdamW, and the LR schedule against its formulas."""

import math

import pytest
import torch
from torch import nn

from moetrain.config.schema import OptimConfig
from moetrain.train.lr import lr_at
from moetrain.train.optim import PrecisionAwareAdamW, wants_weight_decay
from moetrain.train.throughput import peak_tflops


class Tiny(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(10, 6)
        self.proj = nn.Linear(6, 6)
        self.norm = nn.Parameter(torch.ones(6))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        self.to(dtype)

    def forward(self, ids):
        return (self.proj(self.embed(ids)) * self.norm).pow(2).mean()


def run_steps(opt, model, steps, lr=1e-2, accum=1):
    ids = torch.arange(10).view(2, 5)
    for _ in range(steps):
        opt.zero_grad()
        for i in range(accum):
            model(ids + i % 2 * 0).mul(1.0 + i).backward()
        opt.step(lr)


def torch_reference(cfg, steps, lr=1e-2, accum=1):
    model = Tiny()
    decay = [p for n, p in model.named_parameters() if wants_weight_decay(n, p)]
    rest = [p for n, p in model.named_parameters() if not wants_weight_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    ids = torch.arange(10).view(2, 5)
    for _ in range(steps):
        opt.zero_grad()
        for i in range(accum):
            model(ids).mul(1.0 + i).backward()
        opt.step()
    return model


def test_weight_decay_groups():
    assert wants_weight_decay("layers.0.attn.q_proj.weight", nn.Parameter(torch.ones(2, 2)))
    assert wants_weight_decay("layers.1.mlp.experts.w1", nn.Parameter(torch.ones(2, 2, 2)))
    assert not wants_weight_decay("layers.1.mlp.experts.b1", nn.Parameter(torch.ones(2, 2)))
    assert not wants_weight_decay("layers.0.attn.q_proj.bias", nn.Parameter(torch.ones(2)))
    assert not wants_weight_decay("embed.weight", nn.Parameter(torch.ones(2, 2)))
    assert not wants_weight_decay("final_norm.weight", nn.Parameter(torch.ones(2)))


def test_fp32_matches_torch_adamw():
    cfg = OptimConfig(weight_decay=0.1)
    model = Tiny()
    opt = PrecisionAwareAdamW(model.named_parameters(), cfg, master_weights=True)
    run_steps(opt, model, 5, accum=2)
    ref = torch_reference(cfg, 5, accum=2)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_bf16_params_fp32_master_and_main_grads():
    cfg = OptimConfig(weight_decay=0.1)
    ids = torch.arange(10).view(2, 5)
    # The bf16 gradients of two micro-batches, taken from an identical model without hooks.
    plain = Tiny(torch.bfloat16)
    per_micro = []
    for scale in (1.0, 3.0):
        plain.zero_grad()
        plain(ids).mul(scale).backward()
        per_micro.append([p.grad.clone() for p in plain.parameters()])
    model = Tiny(torch.bfloat16)
    opt = PrecisionAwareAdamW(model.named_parameters(), cfg, master_weights=True)
    opt.zero_grad()
    for scale in (1.0, 3.0):
        model(ids).mul(scale).backward()  # the hook moves each bf16 grad into the fp32 buffer
    for s, g1, g2 in zip(opt.slots, *per_micro):
        assert s.main_grad.dtype == torch.float32 and s.param.grad is None
        assert torch.equal(s.main_grad, g1.float() + g2.float())  # exact fp32 sum, no bf16 rounding
    masters_before = [s.master.clone() for s in opt.slots]
    opt.step(1e-2)
    for s, before in zip(opt.slots, masters_before):
        assert s.master.dtype == torch.float32
        assert torch.equal(s.param.data, s.master.to(torch.bfloat16))
        # Adam's first step moves each weight by lr * sign(grad) (plus decoupled decay).
        decay = 1e-2 * 0.1 * before if s.decay else 0.0
        want = before - decay - 1e-2 * torch.sign(s.main_grad)
        big = s.main_grad.abs() > 1e-4  # eps matters only for tiny gradients
        torch.testing.assert_close(s.master[big], want[big], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype,state", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_fused_and_explicit_paths_agree(dtype, state):
    cfg = OptimConfig(weight_decay=0.1, main_grads_dtype=state, exp_avg_dtype=state, exp_avg_sq_dtype=state)
    models = [Tiny(dtype), Tiny(dtype)]
    opts = [PrecisionAwareAdamW(m.named_parameters(), cfg, master_weights=False, fused=f)
            for m, f in zip(models, (True, False))]
    assert opts[0].fused and not opts[1].fused
    for opt, model in zip(opts, models):
        run_steps(opt, model, 4)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 rounds m, v and w at different points
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    moved = [not torch.equal(a, b) for a, b in zip(models[0].parameters(), Tiny(dtype).parameters())]
    assert all(moved)  # the update did something, so agreement is not vacuous


def test_bf16_moment_state_tracks_fp32():
    model_a, model_b = Tiny(), Tiny()
    opt_a = PrecisionAwareAdamW(model_a.named_parameters(), OptimConfig(), master_weights=True)
    opt_b = PrecisionAwareAdamW(model_b.named_parameters(),
                                OptimConfig(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"), master_weights=True)
    run_steps(opt_a, model_a, 4)
    run_steps(opt_b, model_b, 4)
    assert all(s.exp_avg.dtype == torch.bfloat16 and s.exp_avg_sq.dtype == torch.bfloat16 for s in opt_b.slots)
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


def test_state_dict_round_trip_continues_identically():
    cfg = OptimConfig()
    model = Tiny(torch.bfloat16)
    opt = PrecisionAwareAdamW(model.named_parameters(), cfg, master_weights=True)
    run_steps(opt, model, 3)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = {"step": opt.step_count,
                 "params": {k: {n: t.clone() for n, t in e.items()} for k, e in opt.state_dict()["params"].items()}}
    run_steps(opt, model, 2)
    model2 = Tiny(torch.bfloat16)
    model2.load_state_dict(saved_model)
    opt2 = PrecisionAwareAdamW(model2.named_parameters(), cfg, master_weights=True)
    opt2.load_state_dict(saved_opt)
    run_steps(opt2, model2, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_grad_norm_and_scale():
    model = Tiny()
    opt = PrecisionAwareAdamW(model.named_parameters(), OptimConfig(), master_weights=True)
    model(torch.arange(10).view(2, 5)).backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(opt.grad_norm(), want)
    opt.scale_grads(0.5)
    torch.testing.assert_close(opt.grad_norm(), want * 0.5)


def test_lr_schedule_shapes():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay="cosine")
    assert lr_at(0, o, 110) == pytest.approx(0.1)
    assert lr_at(9, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    assert lr_at(500, o, 110) == pytest.approx(0.1)
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay="linear", decay_steps=4)
    assert [lr_at(s, lin, 100) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    const = OptimConfig(lr=0.5, min_lr=0.0, warmup_steps=2, decay="constant")
    assert [lr_at(s, const, 10) for s in range(4)] == pytest.approx([0.25, 0.5, 0.5, 0.5])


def test_min_lr_default_is_a_tenth_of_lr():
    o = OptimConfig(lr=2e-4, warmup_steps=2, decay="cosine")
    assert o.min_lr is None and o.min_lr_value == pytest.approx(2e-5)
    assert lr_at(1, o, 12) == pytest.approx(2e-4)
    assert lr_at(12, o, 12) == pytest.approx(2e-5)  # decay over the 10 steps after warmup ends at lr / 10
    explicit = OptimConfig(lr=2e-4, min_lr=0.0, warmup_steps=2, decay="linear")
    assert explicit.min_lr_value == 0.0 and lr_at(12, explicit, 12) == 0.0


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup, decay_steps, total", [(2000, None, 200), (2000, 68_000, 200), (0, None, 1),
                                                        (5, 3, 10), (10, None, 10)])
def test_schedule_of_a_short_run_stays_between_zero_and_the_peak(decay, warmup, decay_steps, total):
    """A preset's published schedule (warmup 2000, decay over 68K steps) run for a few steps: valid, no blow-up."""
    o = OptimConfig(lr=2.2e-4, min_lr=2.2e-5, warmup_steps=warmup, decay=decay, decay_steps=decay_steps)
    lrs = [lr_at(s, o, total) for s in range(total)]
    assert all(math.isfinite(x) and 0 < x <= o.lr * (1 + 1e-12) for x in lrs)
    if warmup >= total:  # only the ramp: rising, below the peak until its last step
        assert lrs == sorted(lrs) and lrs[-1] == pytest.approx(o.lr * total / warmup)
    elif decay != "constant":
        after = lrs[warmup:]
        assert after == sorted(after, reverse=True) and min(after) >= o.min_lr_value


def test_peak_table():
    assert peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("AMD Instinct MI300X", "bf16") == pytest.approx(1307.4)
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bf16") is None
    assert peak_tflops("NVIDIA H200", "fp32") is None
    assert peak_tflops(None, "bf16") is None
