"""The planner's activation formula for the fused expert path (moe.backend=triton, what auto runs on a
GPU in bf16) equals the bytes the block really keeps for backward, run here in Triton's CPU
interpreter in fp32 (tests/plan/test_activations.py does the same for the PyTorch path)."""

import dataclasses
import os
import sys

import pytest

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "plan"))
import test_activations as TA  # noqa: E402  (the storage tracker and the tiny config)

import torch  # noqa: E402

import moetrain.models.moe.router as router_mod  # noqa: E402
from moetrain.plan import activations as A  # noqa: E402


CASES = {
    "shared-groups": {},
    "clamped-bias": {**TA.GQA, "moe.activation": "swiglu_clamped", "moe.expert_linear_bias": "true",
                     "moe.num_shared_experts": 0},
    "softmax-zloss": {"moe.score_function": "softmax", "moe.num_groups": "null", "moe.topk_groups": "null",
                      "moe.expert_bias": "false", "moe.z_loss_coeff": 0.01},
}


@pytest.mark.skipif(ON_GPU, reason="the CPU interpreter run; on a GPU plan validate measures the fused path")
@pytest.mark.parametrize("routing", ["auto", "triton"])
@pytest.mark.parametrize("mode", ["none", "selective"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_path_saved_bytes_equal_formula(case, mode, routing, monkeypatch):
    cfg = TA.tiny(**{"moe.backend": "triton", **CASES[case]})  # the fused expert path, here in fp32
    if routing == "auto":  # what backend auto runs on a GPU in bf16: the fused experts, PyTorch routing
        real_route = router_mod.route
        monkeypatch.setattr(router_mod, "route", lambda *a, **kw: real_route(*a, **{**kw, "impl": "torch"}))
    measured = TA.saved_bytes(cfg, True, None, mode, torch.float32)
    if routing == "auto":
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, backend="auto"))
        real_plan = A.moe_plan  # this fp32 run stands in for bf16: the plan as in bf16
        monkeypatch.setattr(A, "moe_plan", lambda c, d: real_plan(
            dataclasses.replace(c, precision=dataclasses.replace(c.precision, dtype="bf16")), d))
    # The block as the formula sees it on this CPU (its SDPA kernels), with the routed experts as they are
    # on a GPU, where this path runs (selective recompute keeps none of them).
    cpu, gpu = A.Dims(B=2, S=16, b=4, device="cpu"), A.Dims(B=2, S=16, b=4, device="cuda")
    assert A.moe_plan(cfg, gpu).fused and A.moe_plan(cfg, cpu).fused == (routing == "triton")
    expected = A.total(A.block_terms(cfg, cpu, True, None, mode))
    if mode == "none":
        expected += A.total(A.routed_experts(cfg, gpu)) - A.total(A.routed_experts(cfg, cpu))
    assert expected == measured
