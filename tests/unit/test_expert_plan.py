"""runtime.expert_plan: one rule for the MoE layer's kernels, asked by the ops at run time and by the planner."""

import pytest
import torch

from moetrain.config import load_config
from moetrain.plan import activations as A
from moetrain.runtime.expert_plan import ExpertPlan, expert_plan, plan_for


def test_auto_on_a_gpu_in_bf16_is_the_fused_path_with_the_routing_kernel_and_tensor_core_logits():
    assert expert_plan("auto", device="cuda", dtype="bf16") == ExpertPlan(
        routing="triton", logits="tensor_core", gemm="auto", rows="triton")
    assert expert_plan("auto", device="cuda", dtype="bf16").fused


@pytest.mark.parametrize("kwargs, want", [
    ({"dtype": "fp32"}, ExpertPlan("triton", "fp32", "torch", "torch")),  # fp32: torch GEMMs, routing kernel
    ({"dtype": "fp64"}, ExpertPlan("torch", "fp32", "torch", "torch")),
    ({"compiling": True}, ExpertPlan("torch", "fp32", "auto", "triton")),  # compile fuses PyTorch's routing
    ({"triton": False}, ExpertPlan("torch", "tensor_core", "torch", "torch")),
    ({"tensor_core_mm": False}, ExpertPlan("triton", "fp32", "auto", "triton")),
    ({"device": "cpu"}, ExpertPlan("torch", "fp32", "loop", "torch")),
])
def test_auto_falls_back_where_a_kernel_cannot_run(kwargs, want):
    assert expert_plan("auto", **{"device": "cuda", "dtype": "bf16", **kwargs}) == want


def test_forced_backends_and_router_gemm():
    assert expert_plan("triton", device="cpu", dtype="fp32") == ExpertPlan("triton", "fp32", "triton", "triton")
    assert expert_plan("torch") == ExpertPlan("torch", "tensor_core", "torch", "torch")
    assert expert_plan("reference") == expert_plan("loop") == ExpertPlan("torch", "fp32", "loop", "torch")
    assert expert_plan("auto", "fp32").logits == "fp32"


def test_unknown_names_are_one_clear_error():
    with pytest.raises(ValueError, match="unknown MoE backend 'cuda'"):
        expert_plan("cuda")
    with pytest.raises(ValueError, match="unknown router GEMM 'bf16'"):
        expert_plan("auto", "bf16")


def test_plan_for_reads_the_tensor():
    assert plan_for(torch.zeros(2, 2), "auto") == expert_plan("auto", device="cpu", dtype="fp32")
    assert plan_for(torch.zeros(2, 2, dtype=torch.float64), "triton").routing == "triton"


def test_the_planner_asks_the_same_rule():
    for backend in ("auto", "triton", "torch", "reference"):
        for dtype in ("bf16", "fp32"):
            cfg = load_config(preset="tiny", overrides=[f"moe.backend={backend}", f"precision.dtype={dtype}"])
            d = A.Dims(B=1, S=16, b=2 if dtype == "bf16" else 4, device="cuda")
            assert A.moe_plan(cfg, d) == expert_plan(backend, device="cuda", dtype=dtype)
