"""Every moetrain:: custom op (moetrain.ops.custom_ops.REGISTERED): its fake implementation gives the real outputs'
shapes, dtypes and strides, and torch.library.opcheck passes (schema, fake tensors, AOT dispatch with dynamic
shapes); then a whole MoE layer with moe.backend=triton (the routing kernel, the fused path) compiled with
fullgraph=True against eager.

Without a GPU the Triton kernels run in the CPU interpreter (fp32); on a GPU this file is skipped (fp32 shapes
would autotune bf16's candidates, see test_moe_fused.py; the GPU compile tests are in tests/unit/test_compile.py).
"""

import copy
import importlib
import os
import sys

import pytest
import torch
from triton_env import use_gpu_or_interpreter

if use_gpu_or_interpreter():
    pytest.skip("interpreter checks of the custom ops: the GPU's compile tests are tests/unit/test_compile.py",
                allow_module_level=True)

from moetrain.kernels import sort_rows as sorting
from moetrain.models.rope import RopeParams
from moetrain.ops import custom_ops, router_gemm

importlib.import_module("moetrain.ops.rope")  # registers rope_fwd / rope_bwd (the models import it too)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))
from test_compile import graph_recorder, layer_step, make_layer, moetrain_ops_in

T, H, I, E, K = 6, 8, 8, 4, 2  # M = 12 routed rows
M = T * K


def _routing(seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[1, 1] = -1  # a dropped assignment
    weight = torch.rand(T, K, generator=g)
    offs, _, inverse, token_of_row = sorting.sort_rows(idx, E)
    return g, idx, weight, offs, inverse, token_of_row


def samples() -> list:
    """(op name, argument tuple) pairs: every registered op, with each optional input present and absent."""
    g, idx, weight, offs, inverse, token_of_row = _routing()

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    x, w1, w2 = rand(T, H), rand(E, 2 * I, H) / 3, rand(E, H, I) / 3
    rows, dh, h = rand(M, H), rand(M, 2 * I), rand(M, 2 * I)
    probs = torch.rand(M, generator=g)
    out = []
    for backend in ("triton", "torch", "loop"):
        out += [("grouped_gemm_fwd", (rows, w1, offs, backend)),
                ("grouped_gemm_dgrad", (rows, w2, offs, backend)),
                ("grouped_gemm_wgrad", (dh, rows, offs, backend))]
    out += [
        ("fc1_fwd", (x, w1, offs, token_of_row, inverse, K, "triton")),
        ("fc1_wgrad", (dh, x, offs, token_of_row, inverse, K, "triton")),
        ("fc1_swiglu", (x, w1, offs, token_of_row, inverse, probs, K, "triton", "swiglu")),
        ("fc1_swiglu", (x, w1, offs, token_of_row, inverse, None, K, "triton", "swiglu_clamped")),
        ("combine", (rows, inverse, weight, K)),
        ("combine", (rows, inverse, None, K)),
        ("combine_bwd", (x, rows, inverse, weight, M)),
        ("token_rows", (x, inverse, M + 3)),  # rows past M (padding) are zeros
        ("swiglu_fwd", (h, probs, "swiglu")),
        ("swiglu_fwd", (h, None, "swiglu_clamped")),
        ("swiglu_bwd", (h, rand(M, I), probs, "swiglu")),
        ("swiglu_bwd", (h, rand(M, I), None, "swiglu_clamped")),
        ("sort_rows", (idx, weight, E)),
        ("sort_rows", (idx, None, E)),
        ("routing_weight_grad", (torch.rand(M, generator=g), inverse, idx, torch.float32)),
        ("route", (rand(T, E), None, K, "softmax", None, None, "max", 1.0, True, True)),
        ("route", (rand(T, E), torch.linspace(-0.1, 0.1, E), K, "sigmoid", 2, 1, "top2_sum", 2.5, True, False)),
        ("route_backward", (rand(T, E), idx.clamp(min=0), rand(T, K), rand(E), "softmax", True, 1.0)),
        ("route_backward", (rand(T, E), idx.clamp(min=0), None, rand(E), "sigmoid", False, 2.0)),
        ("router_mm_fp32", (rand(T, H, dtype=torch.bfloat16), rand(H, E, dtype=torch.bfloat16))),
    ]
    # RoPE (+ q/k norm): x a column slice of a wider projection output (strides of a view), with and without the norm
    cos, sin = RopeParams(8, yarn=True, factor=4.0, original_max_position=2).tables(3)
    q = rand(2, 3, 2, 11)[..., 3:]
    norm_w, dq = rand(8, dtype=torch.bfloat16), rand(2, 3, 2, 8).transpose(1, 2).contiguous().transpose(1, 2)
    rstd = torch.rand(2, 3, 2, generator=g) + 0.5
    out += [("rope_fwd", (q, cos, sin, norm_w, 1e-6)), ("rope_fwd", (q.bfloat16(), cos, sin, None, 1e-6)),
            ("rope_bwd", (dq, q, cos, sin, norm_w, rstd)), ("rope_bwd", (dq, None, cos, sin, None, None))]
    labels = torch.tensor([3, -100, 0, 4, 1, 2])  # V = 5 vocabulary rows; chunks of 4 tokens: one uneven
    for need_dh, need_dw in ((True, True), (True, False), (False, True), (False, False)):
        out.append(("linear_cross_entropy", (x, rand(5, H), labels, 4, -100, 0, "", need_dh, need_dw, True)))
    out.append(("linear_cross_entropy", (x.bfloat16(), rand(5, H, dtype=torch.bfloat16), labels, 4, -100, 0, "",
                                         True, True, False)))
    z = rand(6, 5, dtype=torch.bfloat16)  # the fused loss's kernels (more in test_cross_entropy_kernel.py)
    out += [("cross_entropy_stats", (z, labels, -100, 0)),
            ("cross_entropy_grad", (z.clone(), labels, rand(6), -100, 0)),  # writes over its first argument
            ("cross_entropy_fused", (z.clone(), labels, -100, 2))]
    return out


SAMPLES = samples()
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(SAMPLES)]


@pytest.fixture(autouse=True)
def _cpu_router_mm(monkeypatch):
    """torch.mm(out_dtype=) is CUDA-only: the exact-product stand-in of tests/unit/test_router_gemm.py."""
    monkeypatch.setattr(router_gemm, "_mm_fp32_out", lambda a, b: a.float() @ b.float())


def test_every_registered_op_has_a_sample():
    assert {name for name, _ in SAMPLES} == set(custom_ops.REGISTERED)


def _flat(out):
    if out is None:  # an op that only writes over an input
        return []
    return list(out) if isinstance(out, (list, tuple)) else [out]


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_fake_outputs_match_the_real_ones(sample):
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, args = sample
    call = custom_ops.REGISTERED[name]
    real = _flat(call.impl(*args))
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _flat(call.op(*fake_args))
    assert len(fake) == len(real)
    for f, r in zip(fake, real):
        assert (tuple(f.shape), f.dtype, f.stride()) == (tuple(r.shape), r.dtype, r.stride())
    assert all(torch.isfinite(r).all() for r in real if r.is_floating_point())


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_opcheck(sample):
    name, args = sample
    torch.library.opcheck(custom_ops.REGISTERED[name].op, args)


def test_fullgraph_moe_layer_with_the_kernels_matches_eager():
    # moe.backend=triton: the routing kernel, the sort, FC1 gathered, the SwiGLU kernel, FC2 with the combine, all
    # custom ops in one graph; "aot_eager": the tracing without code generation
    torch._dynamo.reset()
    try:
        layer, x, probe = make_layer("deepseek", "triton")
        want = layer_step(layer, layer, x, probe)
        graphs = []
        compiled = torch.compile(copy.deepcopy(layer), fullgraph=True, backend=graph_recorder(graphs))
        got = layer_step(compiled._orig_mod, compiled, x, probe)
    finally:
        torch._dynamo.reset()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 1
    assert {f"moetrain.{op}.default" for op in ("route", "route_backward", "sort_rows", "fc1_fwd", "swiglu_fwd",
                                                  "swiglu_bwd", "combine", "token_rows", "grouped_gemm_fwd",
                                                  "grouped_gemm_dgrad", "grouped_gemm_wgrad",
                                                  "routing_weight_grad")} <= moetrain_ops_in(graphs)
