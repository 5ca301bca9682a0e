"""torch.compile of the expert path and of a whole MoE layer against eager: forward and every gradient.

On CPU the torch backend compiles whole (fullgraph=True): its grouped GEMMs are custom ops (moetrain::grouped_gemm_*)
with fake implementations, its row ops plain PyTorch. The reference backend reads the group offsets on the host (its
per-expert loop), a graph break: it is compiled with fullgraph=False. Most tests use the "aot_eager" backend (dynamo
and AOTAutograd, the tracing that fullgraph and the fake implementations are about, without code generation); one
runs inductor. The GPU tests compile the Triton kernels' path.
"""

import copy

import pytest
import torch
from test_models_moe import moe_cfg, random_init  # (this directory is on sys.path)

from moetrain import ops
from moetrain.models.moe.layer import MoELayer
from moetrain.ops import router_gemm


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def expert_inputs(T=13, H=16, I=8, E=5, K=2, *, seed=0, bias=False, dtype=torch.float32):
    """Leaves (x, topk_weight, w1, w2, b1, b2) and topk_idx with one dropped assignment and an empty expert."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 empty
    idx[3, 1] = -1
    leaves = [torch.randn(T, H, generator=g), torch.rand(T, K, generator=g),
              torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5]
    if bias:
        leaves += [torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)]
    return idx, [t.to(dtype).requires_grad_() for t in leaves]


def forward_backward(fn, idx, leaves, probe_seed=1):
    """(output, gradient of every leaf) of sum(fn(...) * probe)."""
    for t in leaves:
        t.grad = None
    y = fn(idx, *leaves)
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(probe_seed), dtype=y.dtype).to(y.device)
    (y * probe).sum().backward()
    return [y.detach()] + [t.grad.clone() for t in leaves]


def experts_fn(backend, activation="swiglu"):
    def fn(idx, x, weight, w1, w2, b1=None, b2=None):
        return ops.moe_experts(x, idx, weight, w1, w2, b1=b1, b2=b2, activation=activation, backend=backend)
    return fn


def assert_all_close(got, want, tol):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, i=i: f"output {i}: {m}")


def graph_recorder(graphs):
    """A torch.compile backend that records each FX graph dynamo hands it and runs it through AOTAutograd."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    inner = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=lambda gm, _: make_boxed_func(gm))

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)
    return backend


def moetrain_ops_in(graphs) -> set:
    """Our custom ops called in the graphs, their subgraphs included (an autograd.Function's forward and backward
    bodies)."""
    return {str(n.target) for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
            for n in sub.graph.nodes if n.op == "call_function" and str(n.target).startswith("moetrain.")}


GROUPED_GEMMS = {f"moetrain.grouped_gemm_{op}.default" for op in ("fwd", "dgrad", "wgrad")}


@pytest.mark.parametrize("bias,activation", [(False, "swiglu"), (True, "swiglu_clamped")])
def test_fullgraph_moe_experts_torch_backend_matches_eager(bias, activation):
    idx, leaves = expert_inputs(bias=bias)
    if activation == "swiglu_clamped":
        with torch.no_grad():
            leaves[0].mul_(6)  # past the clamp limit
    fn = experts_fn("torch", activation)
    want = forward_backward(fn, idx, leaves)
    graphs = []
    got = forward_backward(torch.compile(fn, fullgraph=True, backend=graph_recorder(graphs)), idx, leaves)
    assert_all_close(got, want, 1e-6)
    # one graph, with our three grouped GEMM ops in it (the backward's in the autograd nodes' backward bodies)
    assert len(graphs) == 1 and moetrain_ops_in(graphs) == GROUPED_GEMMS


@pytest.mark.slow
def test_fullgraph_moe_experts_inductor_matches_eager():
    idx, leaves = expert_inputs(seed=3)
    fn = experts_fn("torch")
    want = forward_backward(fn, idx, leaves)
    got = forward_backward(torch.compile(fn, fullgraph=True), idx, leaves)
    assert_all_close(got, want, 2e-5)  # inductor fuses the row ops (other summation orders)


def test_reference_backend_compiles_with_graph_breaks_and_matches_eager():
    # the per-expert loop reads the offsets on the host: not fullgraph (that refuses), but it compiles and matches
    idx, leaves = expert_inputs(seed=5, bias=True, dtype=torch.float64)
    fn = experts_fn("reference")
    want = forward_backward(fn, idx, leaves)
    got = forward_backward(torch.compile(fn, backend="aot_eager"), idx, leaves)
    assert_all_close(got, want, 1e-12)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)graph break|data.dependent|tolist|item"):
        forward_backward(torch.compile(fn, fullgraph=True, backend="aot_eager"), idx, leaves)


LAYER_VARIANTS = {
    "deepseek": {"score_function": "sigmoid", "num_groups": 3, "topk_groups": 2, "expert_bias": True,
                 "num_shared_experts": 1, "scaling_factor": 2.5, "aux_loss_coeff": 0.01},
    "gptoss": {"router_bias": True, "expert_linear_bias": True, "activation": "swiglu_clamped", "topk": 3,
               "z_loss_coeff": 0.01, "aux_loss_coeff": 0.01, "aux_loss_type": "sequence"},
    "capacity": {"capacity_factor": 0.6},
}


def layer_step(layer, fwd, x, probe):
    """(y, aux, dx, tokens_per_expert, every parameter's gradient) of one training forward and backward."""
    layer.zero_grad(set_to_none=True)
    layer.reset_stats()
    leaf = x.detach().clone().requires_grad_()
    y = fwd(leaf)  # the aux losses reach the router through y (moe.aux_loss)
    aux = layer.aux_value
    (y * probe).sum().backward()
    return [y.detach(), aux.detach(), leaf.grad, layer.tokens_per_expert.clone()] + [
        p.grad for _, p in sorted(layer.named_parameters())]


def make_layer(variant, backend, dtype=torch.float32, device="cpu"):
    cfg = moe_cfg(**LAYER_VARIANTS[variant], backend=backend)
    layer = MoELayer(cfg)
    random_init(layer, seed=1)
    layer = layer.to(device, dtype).train()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 16, generator=g).to(device, dtype)
    probe = torch.randn(2, 7, 16, generator=g).to(device, dtype)
    return layer, x, probe


@pytest.mark.parametrize("fused", [True, False], ids=["local-fused", "local-unfused"])
@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_fullgraph_moe_layer_torch_backend_matches_eager(variant, fused):
    from moetrain.models.moe.dispatch import LocalDispatcher

    layer, x, probe = make_layer(variant, "torch")
    layer.dispatcher = LocalDispatcher(fused=fused)
    want = layer_step(layer, layer, x, probe)
    graphs = []
    got = layer_step(layer, torch.compile(layer, fullgraph=True, backend=graph_recorder(graphs)), x, probe)
    assert_all_close(got, want, 1e-6)
    assert len(graphs) == 1 and moetrain_ops_in(graphs) == GROUPED_GEMMS


def test_moe_layer_reference_backend_compiles_and_matches_eager():
    layer, x, probe = make_layer("deepseek", "reference", torch.float64)
    want = layer_step(layer, layer, x, probe)
    got = layer_step(layer, torch.compile(layer, backend="aot_eager"), x, probe)
    assert_all_close(got, want, 1e-12)


def test_fullgraph_tensor_core_router_gemm_matches_eager(monkeypatch):
    # the tensor-core router GEMM (its fp32-out GEMMs a custom op; CPU: the exact-product stand-in of
    # test_router_gemm.py, which the op's eager body calls at run time)
    monkeypatch.setattr(router_gemm, "_mm_fp32_out", lambda a, b: a.float() @ b.float())
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 24, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(8, 24, generator=g) * 0.1).bfloat16().requires_grad_()
    b = torch.randn(8, generator=g).bfloat16().requires_grad_()
    probe = torch.randn(33, 8, generator=g)

    def run(fn):
        for t in (x, w, b):
            t.grad = None
        y = fn(x, w, b)
        (y * probe).sum().backward()
        return [y.detach(), x.grad, w.grad, b.grad]

    def fn(x, w, b):
        return ops.router_logits(x, w, b, impl="tensor_core")

    want = run(fn)
    graphs = []
    got = run(torch.compile(fn, fullgraph=True, backend=graph_recorder(graphs)))
    assert_all_close(got, want, 0.0)
    assert moetrain_ops_in(graphs) == {"moetrain.router_mm_fp32.default"}


# ---- GPU: the Triton kernels' path, compiled ----------------------------------------------------------------


def _gpu_ready():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_gpu_fullgraph_moe_experts_kernels_match_eager(backend):
    _gpu_ready()
    idx, leaves = expert_inputs(T=256, H=128, I=64, E=8, K=2, seed=7)
    idx = idx.cuda()
    leaves = [t.detach().cuda().bfloat16().requires_grad_() if i != 1 else t.detach().cuda().requires_grad_()
              for i, t in enumerate(leaves)]
    fn = experts_fn(backend)
    want = forward_backward(fn, idx, leaves)  # eager first: autotuning and auto's choices are made and cached
    graphs = []
    got = forward_backward(torch.compile(fn, fullgraph=True, backend=graph_recorder(graphs)), idx, leaves)
    assert_all_close(got, want, 1e-3)  # the same kernels on the same operands (bf16)
    assert {"moetrain.sort_rows.default", "moetrain.combine.default"} <= moetrain_ops_in(graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_gpu_fullgraph_moe_layer_triton_matches_eager(variant):
    _gpu_ready()
    layer, x, probe = make_layer(variant, "triton", torch.bfloat16, "cuda")
    layer_copy = copy.deepcopy(layer)
    want = layer_step(layer, layer, x, probe)
    got = layer_step(layer_copy, torch.compile(layer_copy, fullgraph=True), x, probe)
    # inductor compiles the PyTorch parts (router losses, shared MLP) its own way: bf16 rounding differs
    assert_all_close(got, want, 2e-2)
