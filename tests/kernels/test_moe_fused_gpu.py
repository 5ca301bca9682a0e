"""GPU checks of the fused expert path and backend="auto" (bf16), and CUDA-graph capture of a whole
MoE layer forward + backward replayed with new routing. Marked gpu: skipped without CUDA.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k.
"""

import json

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
pytest.importorskip("triton", reason="the triton package is not installed")

from moetrain import ops  # noqa: E402
from moetrain import tuning  # noqa: E402
from moetrain.ops import moe_fused  # noqa: E402
from moetrain.train.graphed_step import on_side_stream  # noqa: E402

BACKENDS = ("torch", "triton", "auto")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE_DIR", str(tmp_path))
    tuning.reset()
    yield
    tuning.reset()


def rel(a, b):
    assert not torch.isnan(a).any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make(T, H, I, E, K, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    router = torch.randn(E, H, device="cuda", generator=g) * 0.02
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(dtype)
    return x, router, w1, w2


def route(x, router_w, forcing, K):
    logits = F.linear(x.float(), router_w) + forcing
    weight, idx = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return idx, weight / weight.sum(-1, keepdim=True)


def skewed_forcing(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    shares = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample()
    chosen = torch.multinomial(shares.expand(T, E), K, replacement=False, generator=g)
    forcing = torch.zeros(T, E).scatter_(1, chosen, 50.0 + torch.arange(K, 0, -1).float().expand(T, K))
    return forcing.cuda()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,H,I,E,K", [(1000, 256, 128, 16, 4), (333, 128, 64, 1, 1), (517, 128, 96, 64, 8)])
def test_bf16_matches_fp64_reference(backend, T, H, I, E, K):
    check_against_fp64(backend, T, H, I, E, K)


def fused_fc1_swiglu_only(monkeypatch):
    """auto with FC1 + SwiGLU forced to the fused ping-pong kernel (skips unless it applies: Hopper)."""
    from moetrain.kernels.grouped_gemm import pingpong_applies

    if not pingpong_applies(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("the fused FC1 + SwiGLU kernel needs a Hopper GPU")
    monkeypatch.setattr(moe_fused, "FC1_SWIGLU_VARIANTS", ("fused",))


@pytest.mark.parametrize("T,H,I,E,K", [(1000, 256, 128, 16, 4), (333, 128, 64, 1, 1), (517, 128, 96, 64, 8)])
def test_fused_fc1_swiglu_layer_matches_fp64_reference(monkeypatch, T, H, I, E, K):
    fused_fc1_swiglu_only(monkeypatch)
    check_against_fp64("auto", T, H, I, E, K)


def check_against_fp64(backend, T, H, I, E, K):
    x, router, w1, w2 = make(T, H, I, E, K, seed=T + E)
    idx, weight = route(x, router, skewed_forcing(T, E, K, seed=E), K)
    idx[::7, -1] = -1  # dropped assignments
    probe = torch.randn(T, H, device="cuda")
    outs = {}
    for name in (backend, "reference"):
        cast = (lambda t: t.double()) if name == "reference" else (lambda t: t)  # noqa: E731
        leaves = [cast(t.detach()).clone().requires_grad_() for t in (x, weight, w1, w2)]
        y = ops.moe_experts(leaves[0], idx, leaves[1], leaves[2], leaves[3], backend=name)
        (y.double() * probe.double()).sum().backward()
        outs[name] = [y.detach()] + [t.grad for t in leaves]
    for what, a, b in zip(("out", "dx", "dweight", "dw1", "dw2"), outs[backend], outs["reference"]):
        assert rel(a, b) < 2e-2, what


def test_auto_measures_each_question_once_and_caches_on_disk(tmp_path, monkeypatch):
    # auto = the fused path: FC1's forward and weight-gradient variants, and each of the other GEMMs among torch and
    # our configs (the copy variants' GEMMs are asked too), each question measured once; a new process reads the file
    x, router, w1, w2 = make(2048, 256, 128, 16, 4, seed=1)
    x, w1, w2 = x.requires_grad_(), w1.requires_grad_(), w2.requires_grad_()  # all five GEMMs run
    idx, weight = route(x.detach(), router, torch.zeros(2048, 16, device="cuda"), 4)
    ops.moe_experts(x, idx, weight, w1, w2, backend="auto").sum().backward()
    tuner = tuning.active()
    keys = [d.key for d in tuner.decisions]
    assert len(keys) == len(set(keys))
    kinds = sorted(k.split("|")[0] for k in keys)
    from moetrain.ops.moe_fused import fused_fc1_swiglu_applies

    hopper = fused_fc1_swiglu_applies(x, w1)
    assert {"moe_fc1_fwd", "moe_fc1_wgrad", "gemm_fwd+torch", "gemm_dgrad+torch", "gemm_wgrad+torch"} <= set(kinds)
    assert ("moe_fc1_swiglu" in kinds) == hopper
    entries = json.loads((tmp_path / "tuning.json").read_text())["entries"]
    assert set(entries) == set(keys)
    for key, entry in entries.items():
        if key.startswith("gemm_") and "+torch" in key:
            assert "torch" in entry["ms"]

    def no_timing(run, reps):
        raise AssertionError("timed again despite the cache")

    with tuning.use(tuning.Tuner(timer=no_timing)):  # a new process: reads the file
        ops.moe_experts(x, idx, weight, w1, w2, backend="auto").sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_captures_layer_forward_backward_and_replays_new_routing(backend):
    check_graph_replays(backend)


def test_cuda_graph_replays_the_layer_with_fused_fc1_swiglu(monkeypatch):
    fused_fc1_swiglu_only(monkeypatch)
    check_graph_replays("auto")


def check_graph_replays(backend):
    T, H, I, E, K = 1024, 256, 128, 32, 4
    x0, router, w1, w2 = make(T, H, I, E, K, seed=7)
    router = router.requires_grad_()
    w1, w2 = w1.requires_grad_(), w2.requires_grad_()
    static_x = x0.clone().requires_grad_()
    static_forcing = skewed_forcing(T, E, K, seed=1)
    static_grad = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    params = (static_x, router, w1, w2)

    def layer():
        idx, weight = route(static_x, router, static_forcing, K)
        return ops.moe_experts(static_x, idx, weight, w1, w2, backend=backend)

    def warm_up():  # Triton autotuning, auto's measurement, allocator
        for _ in range(3):
            for p in params:
                p.grad = None
            layer().backward(static_grad)

    on_side_stream(warm_up, static_x.device)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer()
        static_out.backward(static_grad)
    graph_grads = [p.grad for p in params]

    for seed in (2, 3):  # new tokens and new routing, same shapes
        new_x, _, _, _ = make(T, H, I, E, K, seed=100 + seed)
        static_x.data.copy_(new_x)
        static_forcing.copy_(skewed_forcing(T, E, K, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        # Eager on copies of the same inputs.
        leaves = [p.detach().clone().requires_grad_() for p in params]
        idx, weight = route(leaves[0], leaves[1], static_forcing, K)
        out = ops.moe_experts(leaves[0], idx, weight, leaves[2], leaves[3], backend=backend)
        out.backward(static_grad)
        assert rel(static_out, out) < 1e-2
        for got, leaf in zip(graph_grads, leaves):
            assert rel(got, leaf.grad) < 1e-2
