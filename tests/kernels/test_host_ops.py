"""How many host operations one routed layer call issues: route + moe_experts (backend triton), forward and backward,
counted in Triton's CPU interpreter (the PyTorch ops outside our kernels, and our kernels' launches).

Why a test: on the H200's host every PyTorch op costs ~65 us to issue and a Triton launch 35-110 us
(`moetrain bench host`; bench/host_overhead.md), and an eager layer at a few thousand tokens per GPU is
host-bound. An op added to this path, or a zero-filled gradient autograd materializes for an index output of one of
our autograd Functions, shows here first."""

import collections

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain import ops  # noqa: E402

pytestmark = pytest.mark.skipif(ON_GPU, reason="counts the interpreter's launches (the CPU run)")


def count_host_ops(fn):
    """(PyTorch ops by name, kernel launches by name) that fn() issues, our kernels' insides excluded."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from triton.runtime import interpreter

    launches = collections.Counter()
    real = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        with _disable_current_modes():  # the interpreter's own tensor ops are not host ops of the layer
            return real(self, *args, **kwargs)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    interpreter.InterpretedFunction.run = run
    try:
        with Count() as counted:
            fn()
    finally:
        interpreter.InterpretedFunction.run = real
    return counted.ops, launches


def custom_nodes(fn) -> list:
    """Names of the autograd Function nodes (ours: "Backward"-suffixed classes, not AccumulateGrad) under fn."""
    seen, stack, names = set(), [fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() != "torch::autograd::AccumulateGrad":
            names.append(node.name())
        stack.extend(nxt for nxt, _ in node.next_functions)
    return names


def test_a_routed_layer_call_issues_few_host_operations():
    g = torch.Generator().manual_seed(0)
    T, H, I, E, K = 64, 32, 16, 8, 2  # noqa: E741 - the legend's names
    x = torch.randn(T, H, generator=g, requires_grad=True)
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / 8).requires_grad_()
    w2 = (torch.randn(E, H, I, generator=g) / 4).requires_grad_()

    def call():
        r = ops.route(logits, K, impl="triton")
        ops.moe_experts(x, r.topk_idx, r.topk_weight, w1, w2, backend="triton").sum().backward()

    call()  # the counted call is a repeat, as every call of a training run but the first
    torch_ops, launches = count_host_ops(call)
    # autograd nodes of the expert path (each costs the H200's host ~25 us forward and ~50 us backward): the sort,
    # FC1, SwiGLU, FC2 with the combine (one node: moe_fused.fc2_combine), and the routing's
    r = ops.route(logits, K, impl="triton")
    out = ops.moe_experts(x, r.topk_idx, r.topk_weight, w1, w2, backend="triton")
    assert sorted(custom_nodes(out.grad_fn)) == ["GatherFC1Backward", "_FC2CombineBackward",
                                                 "_SortWithWeightsBackward", "_SwiGLUBackward", "_TritonRouteBackward"]
    # one launch per op and direction: routing, sort (2), weights' gradient, SwiGLU, combines, GEMMs (the
    # interpreter's config splits each forward / data gradient into a body and a tail launch: 8 for 4 GEMMs); the
    # combine's backward twice: dout to rows, and x_perm for FC1's weight gradient (moe_rows.token_rows)
    assert dict(launches) == {"_route_kernel": 1, "_chunk_counts_kernel": 1, "_place_rows_kernel": 1,
                              "_rowgroup_kernel": 8, "_swiglu_fwd_kernel": 1, "_combine_kernel": 2,
                              "_combine_bwd_kernel": 2, "_wgrad_kernel": 2, "_swiglu_bwd_kernel": 1,
                              "_weight_grad_kernel": 1, "_route_bwd_kernel": 1}
    # the routing's counts are the only zero fill: none for the index outputs of route or the sort
    assert torch_ops["aten.zeros"] == 1, torch_ops
    # 33 (the test's own sum and its backward included); 55 without the routing backward kernel and the weights
    # carried by the sort (bench/archive/2026-11-30_0217-0349.md)
    assert sum(torch_ops.values()) <= 33, sorted(torch_ops.items(), key=lambda kv: -kv[1])
