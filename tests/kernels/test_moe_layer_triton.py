"""The model's MoE layer with moe.backend=triton (the routing kernel, the fused expert path, the row
kernels) against the same layer with the reference backend: output, aux loss and every gradient.

Without a GPU the kernels run in Triton's CPU interpreter (fp32; the reference runs fp64).
"""

import copy
import os
import sys

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))
from test_models_moe import moe_cfg, random_init  # noqa: E402

from moetrain.models.moe.dispatch import LocalDispatcher  # noqa: E402
from moetrain.models.moe.layer import MoELayer  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
VARIANTS = {
    "deepseek": dict(score_function="sigmoid", num_groups=3, topk_groups=2, expert_bias=True, num_shared_experts=1,
                     scaling_factor=2.5, aux_loss_coeff=0.01),
    "gptoss": dict(router_bias=True, expert_linear_bias=True, activation="swiglu_clamped", topk=3, z_loss_coeff=0.01),
    "capacity": dict(capacity_factor=0.6),
}


pytestmark = pytest.mark.usefixtures("exact_fp32")  # tests/kernels/conftest.py


def run(cfg, state, dtype, x, probe, backend, fused=True):
    cfg = copy.deepcopy(cfg)
    cfg.moe.backend = backend
    layer = MoELayer(cfg).to(DEVICE, dtype)
    layer.dispatcher = LocalDispatcher(fused=fused)
    layer.load_state_dict({k: v.to(DEVICE, dtype) if v.is_floating_point() else v.to(DEVICE) for k, v in state.items()})
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, cfg.moe.num_experts))
    leaf = x.detach().to(DEVICE, dtype, copy=True).requires_grad_()
    y = layer(leaf)  # the aux losses reach the router through y's backward
    aux = layer.aux_value
    (y * probe.to(DEVICE, dtype)).sum().backward()
    grads = {n: p.grad.double().cpu() for n, p in layer.named_parameters()}
    return y.detach().double().cpu(), aux.detach().double().cpu(), leaf.grad.double().cpu(), grads


def case(variant):
    """(config, fp64 layer state, input x [2, 7, 16], output probe) of one VARIANTS entry."""
    cfg = moe_cfg(**VARIANTS[variant])
    layer = MoELayer(cfg).double()
    random_init(layer, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=g)
    probe = torch.randn(2, 7, 16, dtype=torch.float64, generator=g)
    return cfg, layer.state_dict(), x, probe


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_backend_layer_matches_reference(variant):
    cfg, state, x, probe = case(variant)
    want = run(cfg, state, torch.float64, x, probe, "reference")
    got = run(cfg, state, torch.float32, x, probe, "triton")
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    assert got[3].keys() == want[3].keys()
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], rtol=2e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unfused_dispatch_matches_the_fused_path(variant):
    """The unfused composition (rows materialised in expert order by the sort and row kernels, grouped FC1, SwiGLU
    with the weights, FC2, the top-k sum: what an expert-parallel dispatcher sends and receives) against the fused
    path's kernels, fp32: equal up to summation order, forward and every gradient."""
    cfg, state, x, probe = case(variant)
    want = run(cfg, state, torch.float32, x, probe, "triton", fused=True)
    got = run(cfg, state, torch.float32, x, probe, "triton", fused=False)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_layer_runs_the_fused_path_and_matches():
    """Inside torch.compile the fused expert path and the routing kernel are custom ops in the trace (auto
    routes in PyTorch there); the compiled layer matches the eager one (dynamo only: backend "eager", no
    inductor code generation)."""
    torch._dynamo.reset()
    cfg, state, x, probe = case("deepseek")
    want = run(cfg, state, torch.float32, x, probe, "triton")
    real_forward = MoELayer.forward
    try:
        MoELayer.forward = torch.compile(real_forward, backend="eager")
        got = run(cfg, state, torch.float32, x, probe, "triton")
    finally:
        MoELayer.forward = real_forward
        torch._dynamo.reset()
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], rtol=1e-6, atol=1e-6, msg=name)
