"""PrecisionAwareAdamW on its Triton path (kernel=True: forced on the CPU, under Triton's interpreter) against the
same optimizer on the explicit path (kernel=False, fused=False: ``adamw_reference`` per tensor) over 3 steps, for
mixed-precision state: ``step``, ``step_on_device`` (clip inside the kernel, a skipped step), ``grad_norm`` and
what ``explicit_slots`` reports. Bounds as in test_adamw.py (fp32 within 1e-6 relative plus 1e-6 of the largest
value, 16-bit within one bf16 ulp), widened for what a step carries into the next: a 16-bit moment that rounded the
other way at one step (one ulp) moves the next update by up to 2^-8 of it, so 16-bit state within 2 ulps and an
fp32 master within lr x 2^-8 per step more (seen: one ulp, and 0.08 lr x 2^-8, with a bf16 second moment)."""

import pytest
import torch
from torch import nn

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from test_adamw import _check  # noqa: E402

from moetrain.config.schema import OptimConfig  # noqa: E402
from moetrain.kernels.adamw import Tile  # noqa: E402
from moetrain.train.optim import PrecisionAwareAdamW, adamw_reference  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
TILE = None if ON_GPU else Tile(warps=1, per_thread=1, chunk=128)

# (master_weights, main_grads_dtype, exp_avg_dtype, exp_avg_sq_dtype) for bf16 parameters: every one mixes dtypes
STATES = [(True, "fp32", "fp32", "fp32"), (True, "fp32", "bf16", "bf16"), (True, "bf16", "fp32", "bf16"),
          (False, "bf16", "fp32", "fp32"), (False, "fp32", "bf16", "fp32")]


class Odd(nn.Module):
    """Parameters of odd sizes, some decayed (matrices), some not (the bias, the norm, the embedding)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.proj = nn.Linear(7, 65)
        self.norm = nn.Parameter(torch.ones(65))
        self.embed = nn.Embedding(10, 33)
        self.scale = nn.Parameter(torch.ones(1))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.to(device=DEVICE, dtype=torch.bfloat16)


def _pair(state):
    master, grads, m, v = state
    cfg = OptimConfig(weight_decay=0.1, main_grads_dtype=grads, exp_avg_dtype=m, exp_avg_sq_dtype=v)
    models = [Odd(), Odd()]
    kernel = PrecisionAwareAdamW(models[0].named_parameters(), cfg, master, kernel=True)
    explicit = PrecisionAwareAdamW(models[1].named_parameters(), cfg, master, fused=False, kernel=False)
    if TILE is not None:
        kernel._kernels().tile = TILE
    return kernel, explicit


def _fill_grads(opts, seed):
    """The same random gradients into both optimizers (main grads or fresh param.grad: a table rebuilt)."""
    for i, opt in enumerate(opts):
        gen = torch.Generator().manual_seed(seed)
        for s in opt.slots:
            g = (torch.randn(s.param.shape, generator=gen) * 0.3).to(DEVICE)
            if s.main_grad is not None:
                s.main_grad.copy_(g)
            else:
                s.param.grad = g.to(s.param.dtype)


def _compare(kernel, explicit, steps=3, lr=1e-2):
    for a, b in zip(kernel.slots, explicit.slots):
        carried = steps * lr * 2.0 ** -8 if torch.bfloat16 in (a.exp_avg.dtype, a.exp_avg_sq.dtype) else 0.0
        _check(a.param.detach(), b.param.detach(), a.name, ulps=2, atol=carried)
        _check(a.exp_avg, b.exp_avg, a.name, ulps=2)
        _check(a.exp_avg_sq, b.exp_avg_sq, a.name, ulps=2)
        if a.master is not None:
            _check(a.master, b.master, a.name, atol=carried)
            assert torch.equal(a.param.detach(), a.master.to(a.param.dtype)), a.name


@pytest.mark.parametrize("state", STATES, ids=lambda s: "master{}-g{}-m{}-v{}".format(*s))
def test_step_on_the_kernel_matches_the_explicit_path(state):
    kernel, explicit = _pair(state)
    assert kernel.explicit_slots() == [] and len(explicit.explicit_slots()) == len(explicit.slots)
    for step in range(3):
        _fill_grads((kernel, explicit), step)
        torch.testing.assert_close(kernel.grad_norm(), explicit.grad_norm(), rtol=1e-6, atol=0)
        kernel.step(1e-2)
        explicit.step(1e-2)
    _compare(kernel, explicit)
    assert not torch.equal(kernel.slots[0].param, Odd().proj.weight)  # it moved


def _clipped_reference_step(opt, lr, clip, step):
    """The explicit path with step_on_device's clip: each gradient divided by max(1, (norm + 1e-6) / clip) in fp32
    (``scale_grads`` would round a bf16 gradient's scaled copy to bf16, which the kernel never does)."""
    scale = max(1.0, (opt.grad_norm().item() + 1e-6) / clip)
    for s, grad in zip(opt.slots, opt.grads()):
        target = s.master if s.master is not None else s.param.data
        c = opt.cfg
        adamw_reference(target, grad, s.exp_avg, s.exp_avg_sq, lr, step, c.beta1, c.beta2, c.eps,
                        c.weight_decay if s.decay else 0.0, grad_scale=scale)
        if s.master is not None:
            s.param.data.copy_(s.master)
    return scale


@pytest.mark.parametrize("state", STATES, ids=lambda s: "master{}-g{}-m{}-v{}".format(*s))
def test_step_on_device_matches_the_clipped_reference(state):
    """Clip inside the kernel (grad_scale) against the reference's; a skipped step moves nothing, the counter
    included."""
    kernel, explicit = _pair(state)
    clip = 2.0
    for step in range(3):
        _fill_grads((kernel, explicit), step)
        assert _clipped_reference_step(explicit, 1e-2, clip, step + 1) > 1.0  # the clip acts
        kernel.step_on_device(torch.tensor(1e-2, device=DEVICE), kernel.grad_norm(), torch.tensor(1.0, device=DEVICE),
                              clip)
        kernel.count_step()
    _compare(kernel, explicit)
    before = [(s.param.detach().clone(), s.exp_avg.clone(), s.exp_avg_sq.clone()) for s in kernel.slots]
    counter = kernel.device_step_counter(torch.device(DEVICE)).clone()
    _fill_grads((kernel,), 9)
    kernel.step_on_device(1e-2, kernel.grad_norm(), torch.tensor(0.0, device=DEVICE), clip)
    assert torch.equal(kernel.device_step_counter(torch.device(DEVICE)), counter)
    for s, (param, m, v) in zip(kernel.slots, before):
        assert torch.equal(s.param, param) and torch.equal(s.exp_avg, m) and torch.equal(s.exp_avg_sq, v)


def test_norm_counts_every_gradient_on_the_kernel_empty_ones_as_zero():
    """(Under FSDP a rank's shard may be empty; the distributed norm pairs each slot's share with its groups.)"""
    kernel, _ = _pair(STATES[0])
    _fill_grads((kernel,), 0)
    kernel.slots[3].main_grad = torch.zeros(0, device=DEVICE)
    squares = kernel._squares([(g, i) for i, g in enumerate(kernel.grads())])
    got = {i: s[j].item() for s, idx in squares for j, i in enumerate(idx)}
    want = [float(g.double().square().sum()) for g in kernel.grads()]
    assert sorted(got) == list(range(len(kernel.slots))) and got[3] == 0.0
    assert [got[i] for i in range(len(want))] == pytest.approx(want, rel=1e-6)


def test_tables_are_kept_while_the_tensors_stay():
    kernel, _ = _pair(STATES[0])  # fp32 main grads: every address the kernel reads is fixed
    _fill_grads((kernel,), 0)
    kernel.prepare_device_step(torch.device(DEVICE))
    tables = {k: v[1] for k, v in kernel._kernels()._tables.items()}
    assert sorted(k[0] for k in tables) == ["norm", "update"]
    for step in range(2):
        kernel.step_on_device(1e-2, kernel.grad_norm(), torch.tensor(1.0, device=DEVICE), 1.0)
    assert all(kernel._kernels()._tables[k][1] is t for k, t in tables.items())


def test_without_the_kernel_mixed_state_stays_on_the_explicit_path():
    cfg = OptimConfig(exp_avg_dtype="bf16")
    opt = PrecisionAwareAdamW(Odd().named_parameters(), cfg, master_weights=True, kernel=False)
    assert len(opt.explicit_slots()) == len(opt.slots) == 5
    with pytest.raises(RuntimeError, match="step_on_device needs the Triton or the fused AdamW path"):
        opt.step_on_device(1e-2, torch.tensor(1.0), torch.tensor(1.0), 1.0)
    # kernel=None follows optim.triton_kernel: on by default, where the CPU still takes neither Triton nor (mixed
    # dtypes) torch's fused kernel; off, never
    off = PrecisionAwareAdamW(Odd().named_parameters(), OptimConfig(exp_avg_dtype="bf16", triton_kernel=False),
                              master_weights=True)
    assert off.kernel is False and off.explicit_slots() == opt.explicit_slots()
    if not ON_GPU:
        auto = PrecisionAwareAdamW(Odd().named_parameters(), cfg, master_weights=True)
        assert auto.kernel is None and auto.explicit_slots() == opt.explicit_slots()


@pytest.mark.slow
def test_trainer_updates_mixed_state_on_the_device_with_the_kernel(tmp_path):
    """Mixed-precision state (bf16 moments) on the kernel: DeviceUpdateStep, clip and skip inside the kernel; on the
    explicit path: EagerStep, decided on the host. Every step clipped (clip 0.01): both train alike."""
    from moetrain.config.load import load_config
    from moetrain.train.steps import DeviceUpdateStep, EagerStep
    from moetrain.train.trainer import Trainer

    def config(name):
        return load_config(overrides=[
            f"train.out_dir={tmp_path / name}", "train.steps=3", "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.seq_length=32", "optim.warmup_steps=2", "optim.clip_grad=0.01", "optim.exp_avg_dtype=bf16",
            "optim.exp_avg_sq_dtype=bf16", f"train.device={DEVICE}"])

    class Watched(Trainer):
        kernel = True

        def build_optimizer(self):
            opt = PrecisionAwareAdamW(self.model.named_parameters(), self.cfg.optim, self.cfg.precision.master_weights,
                                      fused=self.kernel, kernel=self.kernel)
            if self.kernel and not ON_GPU:  # the interpreter's cost is per operation: one block a tensor
                opt._kernels().tile = Tile(warps=4, per_thread=1024, chunk=131072)
            return opt

        def train_step(self, step):
            self.modes_seen = getattr(self, "modes_seen", set()) | {type(self.step_mode(step))}
            return super().train_step(step)

    class Explicit(Watched):
        kernel = False

    on_device = Watched(config("d"), show_progress=False)
    on_host = Explicit(config("h"), show_progress=False)
    device, host = on_device.run().records, on_host.run().records
    assert on_device.modes_seen == {DeviceUpdateStep} and on_host.modes_seen == {EagerStep}
    assert all(r["grad_norm"] > 0.01 for r in device)  # every step clipped
    assert [r["loss"] for r in host] == pytest.approx([r["loss"] for r in device], rel=1e-4)
    assert [r["grad_norm"] for r in host] == pytest.approx([r["grad_norm"] for r in device], rel=1e-3)
