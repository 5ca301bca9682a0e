"""Deferred weight gradients (moetrain.ops.deferred): inside defer_weight_grads the backward of our expert and router
ops computes input gradients only and queues the weight gradients; run() computes them with the same GEMM calls.

CPU: the torch backend (torch._grouped_mm, fp32) for the grouped GEMMs, the tensor-core router GEMM with the exact
product stand-in of test_router_gemm.py; tests/kernels/test_moe_fused.py checks the fused Triton path.
"""

import collections
import importlib
import warnings

import pytest
import torch

from moetrain import ops
from moetrain.models.recompute import checkpoint
from moetrain.ops import router_gemm

gg = importlib.import_module("moetrain.ops.grouped_gemm")  # (ops.grouped_gemm is the function)


def expert_problem(seed=0, T=13, H=16, I=8, E=5, K=2):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 empty
    idx[2, 0] = -1
    x = torch.randn(T, H, generator=g)
    weight = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    probe = torch.randn(T, H, generator=g)
    return idx, [t.requires_grad_() for t in (x, weight, w1, w2)], probe


@pytest.fixture
def gemm_calls(monkeypatch):
    """Counter of grouped GEMM calls by op (fwd, dgrad, wgrad): every backend's GEMMs pass grouped_gemm._run_op."""
    calls = collections.Counter()
    real = gg._run_op

    def counted(op, backend, a, b, offs):
        calls[op] += 1
        return real(op, backend, a, b, offs)

    monkeypatch.setattr(gg, "_run_op", counted)
    return calls


def grads(leaves):
    out = [None if t.grad is None else t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return out


def experts_loss(idx, leaves, probe, backend="torch"):
    x, weight, w1, w2 = leaves
    return (ops.moe_experts(x, idx, weight, w1, w2, backend=backend) * probe).sum()


def test_deferred_expert_weight_grads_match_and_add_no_gemm(gemm_calls):
    idx, leaves, probe = expert_problem()
    experts_loss(idx, leaves, probe).backward()
    want, want_calls = grads(leaves), dict(gemm_calls)
    gemm_calls.clear()

    with ops.defer_weight_grads() as pending:
        experts_loss(idx, leaves, probe).backward()
    # the backward gave the input gradients and queued FC1's and FC2's weight gradients, unrun
    assert len(pending) == 2 and gemm_calls["wgrad"] == 0
    assert leaves[2].grad is None and leaves[3].grad is None
    torch.testing.assert_close(leaves[0].grad, want[0], rtol=0, atol=0)
    torch.testing.assert_close(leaves[1].grad, want[1], rtol=0, atol=0)
    pending.run()
    assert len(pending) == 0
    got = grads(leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same calls on the same operands
    assert dict(gemm_calls) == want_calls == {"fwd": 2, "dgrad": 2, "wgrad": 2}


def test_deferred_grads_accumulate_into_existing_grads_and_reach_a_cast_weights_leaf():
    # w stored in fp64, cast to fp32 for the op (a non-leaf weight): the deferred gradient flows through the cast into
    # the fp64 leaf's .grad, added to what two earlier backwards left there
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(4, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 12], dtype=torch.int32)  # group 1 empty
    probe = torch.randn(12, 4, generator=g)

    def loss():
        return (ops.grouped_gemm(x, w.float(), offs, backend="torch") * probe).sum()

    for _ in range(3):
        loss().backward()
    want = grads([x, w])
    for _ in range(2):
        loss().backward()
    with ops.defer_weight_grads() as pending:
        loss().backward()
    assert len(pending) == 1 and w.grad is not None  # the two earlier gradients only
    pending.run()
    got = grads([x, w])
    assert got[1].dtype == torch.float64
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_dw_builder_runners_deliver_each_micro_batch_in_any_order():
    # PipelineStage(dw_builder=pending.take): after each micro-batch's backward the stage builds a runner (take), and
    # the schedule's weight step calls it later, here in reverse order
    idx, leaves, probe = expert_problem(seed=2)
    probes = [probe, probe.flip(0)]
    for p in probes:
        experts_loss(idx, leaves, p).backward()
    want = grads(leaves)
    runners = []
    with ops.defer_weight_grads() as pending:
        for p in probes:
            experts_loss(idx, leaves, p).backward()
            runners.append(pending.take())
            assert len(pending) == 0
    assert leaves[2].grad is None
    for run in reversed(runners):
        run()
    for a, b in zip(grads(leaves), want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_zero_bubble_schedule_with_dw_builder_matches_and_runs_each_gemm_once(monkeypatch, gemm_calls):
    # torch's ScheduleInterleavedZeroBubble (F, I, W steps) over two stages on one gloo process, each stage's
    # weight step running what dw_builder=pending.take returned after its input step
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleInterleavedZeroBubble,
    )

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    idx, _, _ = expert_problem(seed=4, T=16)
    stages_modules = [_ResidualExperts(idx, seed) for seed in (1, 2)]
    params = [p for m in stages_modules for p in m.parameters()]
    g = torch.Generator().manual_seed(3)
    x, target = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)

    def loss_fn(y, t):
        return ((y - t) ** 2).sum()

    for xs, ts in ((x[:16], target[:16]), (x[16:], target[16:])):  # the two micro-batches, eagerly
        loss_fn(stages_modules[1](stages_modules[0](xs)), ts).backward()
    want, want_calls = grads(params), dict(gemm_calls)

    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        pending = ops.PendingWeightGrads()
        stages = [PipelineStage(m, i, 2, torch.device("cpu"), dw_builder=pending.take)
                  for i, m in enumerate(stages_modules)]
        schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=2, loss_fn=loss_fn, scale_grads=False)
        with ops.defer_weight_grads(pending):
            schedule.step(x, target=target)  # the first step also infers the stages' shapes
            grads(params)
            gemm_calls.clear()
            schedule.step(x, target=target)
    finally:
        dist.destroy_process_group()
    assert len(pending) == 0
    for a, b in zip(grads(params), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # 2 stages x 2 micro-batches x (FC1, FC2), but for the first stage's FC1 data gradient (its input needs none)
    assert dict(gemm_calls) == want_calls == {"fwd": 8, "dgrad": 6, "wgrad": 8}


class _ResidualExperts(torch.nn.Module):
    """x + moe_experts(x) with fixed routing (idx) and weights: one pipeline stage."""

    def __init__(self, idx, seed):
        super().__init__()
        _, leaves, _ = expert_problem(seed=seed, T=idx.shape[0])
        self.w1 = torch.nn.Parameter(leaves[2].detach().clone())
        self.w2 = torch.nn.Parameter(leaves[3].detach().clone())
        self.register_buffer("idx", idx)

    def forward(self, x):
        weight = torch.full(self.idx.shape, 0.5)
        return x + ops.moe_experts(x, self.idx, weight, self.w1, self.w2, backend="torch")


def test_a_backward_that_does_not_want_a_weight_gradient_skips_its_gemm(gemm_calls):
    # backward(inputs=[x]) inside the context never uses w's gradient: the engine says so, and no weight GEMM runs
    g = torch.Generator().manual_seed(8)
    x = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(4, 4, 8, generator=g, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 12], dtype=torch.int32)
    with ops.defer_weight_grads() as pending:
        (ops.grouped_gemm(x, w, offs, backend="torch").sum()).backward(inputs=[x])
    assert len(pending) == 0 and w.grad is None and x.grad is not None and gemm_calls["wgrad"] == 0
    # torch.autograd.grad of a leaf weight inside the context: computed at once and returned, nothing queued
    with ops.defer_weight_grads() as pending:
        (dw,) = torch.autograd.grad(ops.grouped_gemm(x, w, offs, backend="torch").sum(), [w])
    assert len(pending) == 0 and gemm_calls["wgrad"] == 1
    ((ops.grouped_gemm(x, w, offs, backend="torch")).sum()).backward()
    torch.testing.assert_close(dw, w.grad, rtol=0, atol=0)


def test_deferral_under_activation_recompute():
    # the recomputed forward's saved tensors feed the queued gradients; delivery follows the node's own edge
    idx, leaves, probe = expert_problem(seed=3)

    def loss():
        x, weight, w1, w2 = leaves
        y = checkpoint(lambda a, b: ops.moe_experts(a, idx, b, w1, w2, backend="torch"), x, weight)
        return (y * probe).sum()

    loss().backward()
    want = grads(leaves)
    with ops.defer_weight_grads() as pending:
        loss().backward()
    assert len(pending) == 2
    pending.run()
    for a, b in zip(grads(leaves), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reference_backend_and_plain_layers_are_not_deferred(gemm_calls):
    # plain PyTorch autograd computes every gradient in the backward, inside the context too
    idx, leaves, probe = expert_problem(seed=5)
    experts_loss(idx, leaves, probe, backend="reference").backward()
    want = grads(leaves)
    with ops.defer_weight_grads() as pending:
        experts_loss(idx, leaves, probe, backend="reference").backward()
    assert len(pending) == 0 and not gemm_calls
    for a, b in zip(grads(leaves), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_deferred_tensor_core_router_weight_grad(monkeypatch):
    mm_calls = []

    def mm(a, b):
        mm_calls.append(tuple(a.shape))
        return a.float() @ b.float()

    monkeypatch.setattr(router_gemm, "_mm_fp32_out", mm)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 24, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(8, 24, generator=g) * 0.1).bfloat16().requires_grad_()
    probe = torch.randn(40, 8, generator=g)

    def loss():
        return (ops.router_logits(x, w, impl="tensor_core") * probe).sum()

    loss().backward()
    want, want_calls = grads([x, w]), list(mm_calls)
    mm_calls.clear()
    with ops.defer_weight_grads() as pending:
        loss().backward()
    assert len(pending) == 1 and w.grad is None and mm_calls == [(40, 24)]  # the forward's GEMM only
    pending.run()
    assert mm_calls == want_calls == [(40, 24), (16, 40)]  # forward, then the weight gradient's [2E, T] @ [T, H]
    for a, b in zip(grads([x, w]), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_outside_the_context_nothing_is_queued_and_an_unrun_queue_warns():
    idx, leaves, probe = expert_problem(seed=7)
    with ops.defer_weight_grads() as pending:
        pass
    experts_loss(idx, leaves, probe).backward()
    assert len(pending) == 0 and leaves[2].grad is not None
    grads(leaves)
    with ops.defer_weight_grads() as pending:
        experts_loss(idx, leaves, probe).backward()
    assert len(pending) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pending
        import gc

        gc.collect()
    assert any("2 deferred weight gradients were never run" in str(w.message) for w in caught)
