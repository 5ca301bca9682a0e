"""ops.router_logits: the tensor-core path (bf16 operands, fp32 accumulation, split fp32 gradient)
against the fp32 reference. On CPU torch.mm has no out_dtype: the test stands in the exact-product
equivalent (bf16 products are exact in fp32), which is what the CUDA call computes up to summation order."""

import warnings

import pytest
import torch

from moetrain.ops import router_gemm
from moetrain.ops.router_gemm import router_logits


@pytest.fixture
def exact_mm(monkeypatch):
    def mm(a, b):
        assert a.dtype == b.dtype == torch.bfloat16  # the tensor-core operands
        return a.float() @ b.float()
    monkeypatch.setattr(router_gemm, "_mm_fp32_out", mm)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("T,H,E,bias", [(257, 96, 16, False), (64, 128, 8, True), (1, 32, 1, False)])
def test_tensor_core_path_matches_fp32_reference(exact_mm, T, H, E, bias):
    g = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, H, generator=g).bfloat16()
    w = (torch.randn(E, H, generator=g) * 0.05).bfloat16()
    b = torch.randn(E, generator=g).bfloat16() if bias else None
    probe = torch.randn(T, E, generator=g, dtype=torch.float64)
    outs = {}
    for impl in ("tensor_core", "fp32"):
        leaves = [t.clone().requires_grad_() for t in (x, w)] + ([b.clone().requires_grad_()] if bias else [])
        y = router_logits(leaves[0], leaves[1], leaves[2] if bias else None, impl=impl)
        assert y.dtype == torch.float32 and y.shape == (T, E)
        (y.double() * probe).sum().backward()
        outs[impl] = [y.detach()] + [t.grad for t in leaves]
    got, want = outs["tensor_core"], outs["fp32"]
    assert rel(got[0], want[0]) < 1e-6  # same products, fp32 sums in another order
    for a, b_ in zip(got[1:], want[1:]):
        assert a.dtype == b_.dtype == torch.bfloat16
        # both round an fp32 gradient to bf16 once; the split loses < 2^-16 before that rounding
        assert rel(a, b_) < 4e-3


def test_gradient_split_keeps_sixteen_bits(exact_mm):
    g = torch.randn(1000, 64, generator=torch.Generator().manual_seed(3)) * 1e-3
    hi, lo = router_gemm.split_bf16(g)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert ((hi.float() + lo.float() - g).abs() <= g.abs() * 2.0**-15).all()
    # written in place into one [hi | lo] buffer: the same bits as the definition's casts
    assert torch.equal(hi, g.to(torch.bfloat16)) and torch.equal(lo, (g - hi.float()).to(torch.bfloat16))
    assert torch.equal(router_gemm.split_bf16_cat(g), torch.cat([hi, lo], dim=1))
    # the backward's GEMMs with the split: dx = [hi lo] @ [w; w] and dw = hi^T x + lo^T x against fp32
    x = torch.randn(1000, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    ctx = type("Ctx", (), {"saved_tensors": (x, w), "needs_input_grad": (True, True)})()
    dx, dw = router_gemm._TensorCoreRouterGemm.backward(ctx, g)
    assert rel(dx, (g @ w.float()).bfloat16()) < 2e-3
    assert rel(dw, (g.t() @ x.float()).bfloat16()) < 2e-3


def test_auto_is_fp32_off_cuda_and_errors_are_clear():
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    assert torch.equal(router_logits(x, w), router_logits(x, w, impl="fp32"))  # CPU: the reference
    with pytest.raises(ValueError, match="valid: auto, fp32, tensor_core"):
        router_logits(x, w, impl="tf32")
    with pytest.raises(ValueError, match="needs bf16"):
        router_logits(x.float(), w.float(), impl="tensor_core")
    with pytest.raises(ValueError, match=r"\[T, H\], \[E, H\]"):
        router_logits(x, w.t())
    x64 = torch.randn(4, 8, dtype=torch.float64)
    assert router_logits(x64, torch.randn(3, 8, dtype=torch.float64)).dtype == torch.float64


def new_saved_bytes(fn, *inputs) -> int:
    """Bytes of the storages autograd keeps for backward that are not the inputs' own."""
    own = {t.untyped_storage().data_ptr() for t in inputs}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(kept.values())


def test_saved_bytes_are_what_the_planner_counts(exact_mm):
    """The planner's router terms (plan/activations.router): the fp32 GEMM keeps fp32 copies of x and the
    weight; the tensor-core GEMM keeps nothing new (x is the MoE input, counted once in moe_mlp)."""
    from moetrain.config.load import load_config
    from moetrain.plan import activations as A

    T, H, E = 48, 64, 8
    x = torch.randn(T, H).bfloat16().requires_grad_()
    w = torch.randn(E, H).bfloat16().requires_grad_()
    tc = new_saved_bytes(lambda a, b: router_logits(a, b, impl="tensor_core"), x, w)
    ref = new_saved_bytes(lambda a, b: router_logits(a, b, impl="fp32"), x, w)
    assert tc == 0 and ref == 4 * T * H + 4 * E * H
    cfg = load_config(preset="tiny", overrides=[f"model.hidden_size={H}", f"moe.num_experts={E}"])
    d = A.Dims(B=1, S=T, b=2, device="cuda")
    fp32_cfg = load_config(preset="tiny", overrides=[f"model.hidden_size={H}", f"moe.num_experts={E}",
                                                     "moe.router_gemm=fp32"])
    assert A.moe_plan(cfg, d).logits == "tensor_core" and A.moe_plan(fp32_cfg, d).logits == "fp32"
    copies = sum(t.bytes for t in A.router(fp32_cfg, d) if t.name.startswith("router") and "fp32" in t.name)
    assert copies == ref and not any("fp32" in t.name for t in A.router(cfg, d))


def test_auto_warns_once_and_uses_fp32_when_the_tensor_core_call_fails(monkeypatch):
    def broken(a, b):
        raise RuntimeError("mm.dtype not available")
    monkeypatch.setattr(router_gemm, "_mm_fp32_out", broken)
    monkeypatch.setattr(router_gemm, "tensor_core_applies", lambda x, w: True)
    monkeypatch.setattr(router_gemm, "_unsupported", None)
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(3, 8).bfloat16()
    with pytest.warns(RuntimeWarning, match="fp32 GEMM for the rest of this process"):
        got = router_logits(x, w)
    assert torch.equal(got, router_logits(x, w, impl="fp32"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        router_logits(x, w)  # no second warning, no second try
    with pytest.raises(RuntimeError, match="mm.dtype"):
        router_logits(x, w, impl="tensor_core")  # asked for explicitly: the error itself
