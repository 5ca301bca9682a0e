"""The fused RoPE (+ per-head RMSNorm) kernels (``kernels.rope``, op ``ops.rope.fused_rope``) against the eager
reference (``ops.rope.rope_reference``: the models' RMSNorm then apply_rope) and a float64 one, forward and backward.
On the CPU the kernels run in Triton's interpreter.

Shapes: odd row counts (not a multiple of the tile's rows), h = 1 (MLA's shared key), D = 64 and 128 (and 24: a
half of 12, padded to 16 lanes), MLA's rope dim 64, with default and small tiles (several programs, the backward's
persistent programs walking several row blocks); x and dy as contiguous tensors, as slices of a wider projection
output (MLA's q_rope / k_rope) and as transposed views (an attention backward's gradient); YaRN-scaled tables.

Bounds (per element):
* y equals, bit for bit, an fp32 reference written in the kernel's order given the kernel's rstd (the kernels are
  built without multiply-add contraction, so this holds on a GPU too); rstd is within 1e-6 relative of
  torch.rsqrt(mean(x^2) + eps) (summation order, rsqrt against 1 / sqrt).
* fp32: y, dx and dweight within 1e-5 relative (plus 1e-6 of the tensor's largest value, for elements that cancel)
  of the eager reference's.
* 16-bit: the fused y is within 1 ulp (of x's dtype) of the float64 value, plus 2^-22 of the products' magnitude
  m = |n1 c| + |n2 s| (fp32 residue where they cancel), and within 2 ulps of |y| + 3 ulps of m of the eager y
  (eager rounds n, the tables, both products and their sum to x's dtype: where the products cancel, its error is a
  few ulps of m, not of y, so no bound in ulps of y alone holds). dx is within 1 ulp of the float64 value plus 1e-5
  of the tensor's largest value; dweight (fp32 accumulation) within 1e-5 relative of the float64 value before its
  cast (1 ulp after it). In the 2-norm the fused results are never further from float64 than eager's.
  Seen on the CPU (bf16, these cases): the fused y and dx within 0.5 ulp of float64 everywhere (rounded once from
  fp32); 96-99% of y within 1 ulp of eager's, but eager's y up to ~4000 ulps of y off float64 (and its dx up to
  ~300) where the two products cancel.
"""

import json
import os
import sys

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from kernel_checks import rel_err, script_result  # noqa: E402
from moetrain.kernels import rope as K  # noqa: E402
from moetrain.models.norm import rms_norm  # noqa: E402
from moetrain.models.rope import RopeParams  # noqa: E402
from moetrain.ops import custom_ops  # noqa: E402
from moetrain.ops import rope as R  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS = 1e-6
BITS = {BF16: 8, F16: 11, F32: 24}  # significant bits

# name: (B, S, h, D, layout, tile rows or None (the default tile), YaRN tables)
CASES = {
    "gqa-d64": (2, 7, 3, 64, "contiguous", None, False),
    "d128-h1-slice-tile4": (1, 5, 1, 128, "slice", 4, False),
    "mla-q-rope64-transposed-yarn": (2, 9, 2, 64, "transposed", 4, True),
    "mla-k-rope64-h1-slice": (3, 5, 1, 64, "slice", None, True),
    "d24-padded-lanes": (2, 3, 2, 24, "contiguous", 2, False),
}
DTYPES = {"fp32": F32, "bf16": BF16}
EXTRA = [("d128-h1-slice-tile4", "fp16")]  # fp16 on one case


def _ids():
    out = [(c, d) for c in CASES for d in DTYPES] + EXTRA
    return [pytest.param(c, d, id=f"{c}-{d}") for c, d in out]


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to t [B, S, h, D] laid out as ``layout`` (its last dim contiguous)."""
    B, S, h, D = t.shape
    if layout == "contiguous":
        return t.contiguous()
    if layout == "slice":  # the last D columns of a wider per-head row (MLA's q_rope; its kv_a split for h = 1)
        wide = torch.full((B, S, h, D + 3), float("nan"), dtype=t.dtype, device=t.device)
        wide[..., 3:] = t
        return wide[..., 3:]
    assert layout == "transposed"  # [B, h, S, D] memory: an attention gradient seen as [B, S, h, D]
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _inputs(case, dtype_name, seed=0):
    B, S, h, D, layout, rows, yarn = CASES[case]
    dtype = {**DTYPES, "fp16": F16}[dtype_name]
    g = torch.Generator().manual_seed(seed)
    x = _layout((torch.randn(B, S, h, D, generator=g) * 3).to(dtype).to(DEVICE), layout)
    dy = _layout(torch.randn(B, S, h, D, generator=g).to(dtype).to(DEVICE), layout)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)  # a 16-bit model's weight is 16-bit
    params = RopeParams(D, yarn=yarn, factor=8.0, original_max_position=4, mscale=1.0, mscale_all_dim=0.5)
    if yarn:
        assert params.cos_sin_scale != 1.0
    cos, sin = params.tables(S, device=DEVICE)
    tile = K.RopeTile(rows) if rows else None
    return x, dy, w, cos, sin, tile


def _ulp(v: torch.Tensor, dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at each value of v (float64; the smallest normal's at zero)."""
    tiny = torch.finfo(dtype).tiny
    _, e = torch.frexp(v.double().abs().clamp_min(tiny))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - BITS[dtype])


def _fused_way(x, cos, sin, w, rstd):
    """The kernel's forward in fp32 torch ops, in its order, given its rstd; rounded once to x's dtype."""
    n = x.float()
    if w is not None:
        n = n * rstd[..., None] * w.float()
    n1, n2 = n.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([n1 * c - n2 * s, n2 * c + n1 * s], dim=-1).to(x.dtype)


def _reference(x, cos, sin, w, dy, dtype=None):
    """(y, dx, dweight or None) of rope_reference with autograd, computed in ``dtype`` (default x's)."""
    dtype = dtype or x.dtype
    xr = x.detach().to(dtype).requires_grad_()
    wr = None if w is None else w.detach().to(dtype).requires_grad_()
    tables = (cos, sin) if dtype != torch.float64 else (cos.double(), sin.double())
    y = R.rope_reference(xr, *tables, wr, EPS)
    grads = torch.autograd.grad(y, [xr] + ([wr] if wr is not None else []), dy.to(dtype))
    return y.detach(), grads[0], grads[1] if w is not None else None


def _magnitude(x, cos, sin, w):
    """m = |n1 c| + |n2 s| (and |n2 c| + |n1 s|) in float64: the size of the two products each y sums."""
    n = x.double() if w is None else rms_norm(x.double(), w.double(), EPS)
    n1, n2 = n.abs().chunk(2, dim=-1)
    c, s = cos.double().abs()[:, None, :], sin.double().abs()[:, None, :]
    return torch.cat([n1 * c + n2 * s, n2 * c + n1 * s], dim=-1)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope"])
@pytest.mark.parametrize("case,dtype_name", _ids())
def test_forward(case, dtype_name, norm):
    x, _, w, cos, sin, tile = _inputs(case, dtype_name)
    w = w if norm else None
    y, rstd = K.rope_fwd(x, cos, sin, w, EPS, tile)
    assert y.is_contiguous() and y.shape == x.shape and y.dtype == x.dtype
    assert (rstd is not None) == norm
    if norm:
        want = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
        torch.testing.assert_close(rstd, want, rtol=1e-6, atol=0)
    assert torch.equal(y, _fused_way(x, cos, sin, w, rstd))
    eager, _, _ = _reference(x, cos, sin, w, torch.zeros_like(x))
    if x.dtype == F32:
        torch.testing.assert_close(y, eager, rtol=1e-5, atol=1e-6 * eager.abs().max().item())
        return
    exact, _, _ = _reference(x, cos, sin, w, torch.zeros_like(x), torch.float64)
    m = _magnitude(x, cos, sin, w)
    assert ((y.double() - exact).abs() <= _ulp(exact, x.dtype) + 2.0 ** -22 * m).all()
    assert ((y.double() - eager.double()).abs() <= 2 * _ulp(exact, x.dtype) + 3 * _ulp(m, x.dtype)).all()
    assert rel_err(y, exact) <= rel_err(eager, exact)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope"])
@pytest.mark.parametrize("case,dtype_name", _ids())
def test_backward(case, dtype_name, norm):
    x, dy, w, cos, sin, tile = _inputs(case, dtype_name)
    w = w if norm else None
    _, rstd = K.rope_fwd(x, cos, sin, w, EPS, tile)
    dx, dw = K.rope_bwd(dy, x if norm else None, cos, sin, w, rstd, tile)
    assert dx.is_contiguous() and dx.shape == x.shape and dx.dtype == x.dtype
    assert (dw is not None) == norm and (dw is None or dw.dtype == F32)
    _, dx_eager, dw_eager = _reference(x, cos, sin, w, dy)
    _, dx_exact, dw_exact = _reference(x, cos, sin, w, dy, torch.float64)
    if x.dtype == F32:
        torch.testing.assert_close(dx, dx_eager, rtol=1e-5, atol=1e-6 * dx_eager.abs().max().item())
        assert rel_err(dx, dx_exact) < 1e-6
        if norm:
            torch.testing.assert_close(dw, dw_eager, rtol=1e-5, atol=1e-6 * dw_eager.abs().max().item())
            assert rel_err(dw, dw_exact) < 1e-6
        return
    slack = 1e-5 * dx_exact.abs().max()
    assert ((dx.double() - dx_exact).abs() <= _ulp(dx_exact, x.dtype) + slack).all()
    assert rel_err(dx, dx_exact) <= rel_err(dx_eager, dx_exact)
    if norm:
        assert ((dw.double() - dw_exact).abs() <= 1e-5 * dw_exact.abs() + 1e-6 * dw_exact.abs().max()).all()
        cast = dw.to(w.dtype).double()
        assert ((cast - dw_exact).abs() <= _ulp(dw_exact, w.dtype) + 1e-6 * dw_exact.abs().max()).all()


def test_op_autograd_and_determinism():
    """fused_rope through autograd: x and a bf16 weight get their gradients (dweight cast to the weight's dtype), the
    same bits on a second run (the dweight partials are summed in a fixed order)."""
    x, dy, w, cos, sin, _ = _inputs("mla-q-rope64-transposed-yarn", "bf16")
    runs = []
    for _ in range(2):
        xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = R.fused_rope(xr, cos, sin, wr, EPS)
        y.backward(dy)
        runs.append((y, xr.grad, wr.grad))
    (y, dx, dw), again = runs
    assert dw.dtype == BF16 and dx.dtype == BF16
    assert all(torch.equal(a, b) for a, b in zip(runs[0], again))
    want_dx, want_dw = K.rope_bwd(dy, x, cos, sin, w, K.rope_fwd(x, cos, sin, w, EPS)[1])
    assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw.to(BF16))
    xr = x.detach().requires_grad_()  # without a weight only x's gradient
    R.fused_rope(xr, cos, sin).backward(dy)
    assert torch.equal(xr.grad, K.rope_bwd(dy, None, cos, sin)[0])


def test_checks():
    x, _, w, cos, sin, _ = _inputs("gqa-d64", "fp32")
    with pytest.raises(ValueError, match=r"cos \(6, 32\) torch.float32 must be \[S, D/2\] = \[7, 32\]"):
        K.rope_fwd(x, cos[:6], sin[:6])
    with pytest.raises(ValueError, match=r"cos .* must be .* float32"):
        K.rope_fwd(x, cos.double(), sin)
    with pytest.raises(ValueError, match=r"weight \(63,\) must be \[D\] = \[64\]"):
        K.rope_fwd(x, cos, sin, w[:63])
    with pytest.raises(ValueError, match=r"must be \[B, S, h, D\] with D even"):
        K.rope_fwd(x[..., :63], cos, sin)
    with pytest.raises(ValueError, match=r"with a weight, x must be"):
        K.rope_bwd(x, None, cos, sin, w, None)
    # the attention modules' switch: CUDA tensors of the kernels' dtypes with fp32 tables
    assert R.fused_rope_runs_here(x, cos) == ON_GPU
    assert not R.fused_rope_runs_here(x.double(), cos) and not R.fused_rope_runs_here(x, cos.double())


def test_registered_ops():
    """rope_fwd / rope_bwd are moetrain:: custom ops (torch.library.opcheck of both, every optional input present and
    absent, runs in tests/kernels/test_custom_ops.py on the CPU); their fake outputs have the real ones' shapes,
    dtypes and strides here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert {"rope_fwd", "rope_bwd"} <= set(custom_ops.REGISTERED)
    x, dy, w, cos, sin, _ = _inputs("mla-q-rope64-transposed-yarn", "bf16")
    rstd = K.rope_fwd(x, cos, sin, w, EPS)[1]
    for name, args in (("rope_fwd", (x, cos, sin, w, EPS)), ("rope_fwd", (x, cos, sin, None, EPS)),
                       ("rope_bwd", (dy, x, cos, sin, w, rstd)), ("rope_bwd", (dy, None, cos, sin, None, None))):
        call = custom_ops.REGISTERED[name]
        real = call.impl(*args)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake = call.op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        assert [(tuple(f.shape), f.dtype, f.stride()) for f in fake] == \
            [(tuple(r.shape), r.dtype, r.stride()) for r in real]


# ---- the attention modules through the fused path (forced on the CPU through the interpreter) ------------------


def _attention(kind, dtype):
    from moetrain.config.schema import Config
    from moetrain.models.attention import GQAAttention, MLAttention

    cfg = Config()
    m = cfg.model
    m.hidden_size, m.num_attention_heads, m.norm_eps = 32, 4, 1e-5
    if kind == "gqa":
        m.num_query_groups, m.head_dim, m.qk_norm = 2, 64, True
        build = GQAAttention
    else:
        m.attention_type, m.q_lora_rank, m.kv_lora_rank = "mla", 16, 16
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 8, 64, 8
        m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position = "yarn", 8.0, 4
        build = MLAttention
    torch.manual_seed(0)
    attn = build(cfg)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return attn.to(dtype).to(DEVICE), attn.rope


def _step(attn, rope, x, dy):
    cos, sin = rope.tables(x.shape[1], device=DEVICE)
    xr = x.detach().requires_grad_()
    y = attn(xr, cos, sin)
    y.backward(dy)
    module = getattr(attn, "_orig_mod", attn)  # (a compiled module's parameters are its original's)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return y.detach(), xr.grad, grads


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_attention_fused_path_matches_eager(kind, dtype_name, monkeypatch):
    """GQAAttention with q/k norms and MLAttention (YaRN, the shared rope key rotated once and expanded): output,
    input and parameter gradients through fused_rope as through the eager RMSNorm + apply_rope; fp32 within 1e-5
    relative, bf16 within the eager bf16 path's own distance from the fp32 module (twice it, in the 2-norm)."""
    dtype = DTYPES[dtype_name]
    attn, rope = _attention(kind, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 32, generator=g).to(dtype).to(DEVICE)
    dy = torch.randn(2, 5, 32, generator=g).to(dtype).to(DEVICE)
    calls = []
    real = R.fused_rope

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(R, "fused_rope", counted)
    monkeypatch.setattr(R, "fused_rope_runs_here", lambda x, cos: False)
    eager = _step(attn, rope, x, dy)
    assert not calls
    monkeypatch.setattr(R, "fused_rope_runs_here", lambda x, cos: True)
    fused = _step(attn, rope, x, dy)
    assert calls == [(2, 5, 4, 64), (2, 5, 1 if kind == "mla" else 2, 64)]  # q (MLA: q_rope), k (MLA: k_rope once)
    pairs = [(fused[0], eager[0], "y"), (fused[1], eager[1], "dx")]
    pairs += [(fused[2][n], eager[2][n], n) for n in eager[2]]
    if dtype == F32:
        for got, want, name in pairs:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)
        return
    monkeypatch.setattr(R, "fused_rope_runs_here", lambda x, cos: False)
    wide, _ = _attention(kind, F32)
    ref = _step(wide, rope, x.float(), dy.float())
    refs = [ref[0], ref[1]] + [ref[2][n] for n in eager[2]]
    for (got, want, name), exact in zip(pairs, refs):
        assert rel_err(got, exact) <= 2 * rel_err(want, exact) + 1e-3, name


# ---- what the fused path keeps for backward: the planner's CUDA terms -------------------------------------------


@pytest.mark.skipif(ON_GPU, reason="the CPU interpreter run; on a GPU plan validate measures the fused path")
@pytest.mark.parametrize("b", [4, 2], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective"])
@pytest.mark.parametrize("kind", ["gqa-qknorm", "gqa", "mla"])
def test_fused_path_saved_bytes_equal_the_cuda_formula(kind, mode, b, monkeypatch):
    """A dense decoder block with fused_rope forced, measured with the storage tracker, equals the planner's block
    terms on this CPU (its SDPA kernels) with the RoPE / q-k norm terms as on CUDA (``activations.rope_terms``):
    with the norm, x (the projection output it views) and an fp32 rstd per row; without, nothing of its own."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "plan"))
    import test_activations as TA

    from moetrain.plan import activations as A

    over = {"gqa-qknorm": {**TA.GQA, "model.qk_norm": "true"}, "gqa": TA.GQA, "mla": {}}[kind]
    cfg = TA.tiny(**over)
    monkeypatch.setattr(R, "fused_rope_runs_here", lambda x, cos: True)
    measured = TA.saved_bytes(cfg, False, None, mode, TA.DT[b])
    cpu, gpu = A.Dims(B=2, S=16, b=b, device="cpu"), A.Dims(B=2, S=16, b=b, device="cuda")
    expected = A.total(A.block_terms(cfg, cpu, False, None, mode))
    expected += A.total(A.rope_terms(cfg, gpu)) - A.total(A.rope_terms(cfg, cpu))
    assert expected == measured
    if kind == "gqa-qknorm":  # the fused op's own: q and k (b bytes) and their rstd, against eager's norms + tables
        T, nh, kv, hd = 32, 4, 2, 8
        assert A.total(A.rope_terms(cfg, gpu)) == (b * hd + 4) * T * (nh + kv)


# ---- the bytes the module doc counts, and the compiled kernels -------------------------------------------------


def _eager_bytes(weight: bool):
    """(forward, backward) bytes per element of x and launches of the eager path (module doc of kernels.rope)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def nbytes(t):
        n = 1
        for size, stride in zip(t.shape, t.stride()):
            n *= size if stride else 1
        return n * t.element_size()

    class Count(TorchDispatchMode):
        bytes, launches = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            storages = {a.untyped_storage().data_ptr() for a in ins}
            if outs and not all(o.untyped_storage().data_ptr() in storages for o in outs):  # not a view
                self.bytes += sum(map(nbytes, ins)) + sum(map(nbytes, outs))
                self.launches += 1
            return out

    B, S, h, D = 1, 8, 64, 128
    x = torch.randn(B, S, h, D, dtype=BF16, requires_grad=True)
    cos, sin = RopeParams(D).tables(S)
    w = torch.ones(D, dtype=BF16, requires_grad=True) if weight else None
    with Count() as fwd:
        y = R.rope_reference(x, cos, sin, w, EPS)
    dy = torch.randn_like(y)
    with Count() as bwd:
        y.backward(dy)
    return fwd.bytes / x.numel(), fwd.launches, bwd.bytes / x.numel(), bwd.launches


@pytest.mark.skipif(ON_GPU, reason="counted on the CPU (the same aten ops)")
def test_eager_bytes_per_element_as_the_module_doc_counts():
    fwd, fwd_launches, bwd, bwd_launches = _eager_bytes(True)
    assert (round(fwd), fwd_launches, round(bwd), bwd_launches) == (58, 18, 124, 25)
    fwd, fwd_launches, bwd, bwd_launches = _eager_bytes(False)
    assert (round(fwd), fwd_launches, round(bwd), bwd_launches) == (18, 9, 20, 8)


_SM90 = r"""
import json, re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetrain.kernels import rope as K
from moetrain.kernels.grouped_gemm_aot import spill_bytes

tile = K.rope_tile(128)
def build(fn, sig, consts, pointers):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.warps, "enable_fp_fusion": False})
    ptx = ck.asm["ptx"]
    return dict(spill=spill_bytes(ptx), fma=len(re.findall(r"\bfma\.", ptx)),
                mul=len(re.findall(r"\bmul\.rn\.f32", ptx)))

ints = ["rows", "S", "HEADS", "sxb", "sxs", "sxh"]
out = {}
for norm in (True, False):
    consts = dict(HALF=64, HAS_NORM=norm, BLOCK_R=tile.rows, BLOCK_H=64)
    fwd = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "w_ptr": "*bf16", "y_ptr": "*bf16",
           "rstd_ptr": "*fp32", **{n: "i32" for n in ints}, "eps": "fp32"}
    out[f"fwd norm={norm}"] = build(K._rope_fwd_kernel, fwd, consts, ["x_ptr", "cos_ptr", "sin_ptr", "y_ptr"])
    bwd = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "w_ptr": "*bf16",
           "rstd_ptr": "*fp32", "dx_ptr": "*bf16", "dw_ptr": "*fp32", "rows": "i32", "blocks": "i32", "S": "i32",
           "HEADS": "i32", **{n: "i32" for n in ["sdb", "sds", "sdh", "sxb", "sxs", "sxh"]}}
    out[f"bwd norm={norm}"] = build(K._rope_bwd_kernel, bwd, consts, ["dy_ptr", "x_ptr", "dx_ptr"])
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_without_spills_or_contraction():
    """Compiled for Hopper (sm_90a) without a GPU, at the default tile for D = 128 in bf16: no register spills, and
    no fused multiply-adds in the PTX (enable_fp_fusion=False: the products round as the fp32 reference's do)."""
    rows = json.loads(script_result(_SM90))
    for name, row in rows.items():
        assert row["spill"] in (0, None), (name, row)
        assert row["fma"] == 0 and row["mul"] > 0, (name, row)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's custom ops under aot_eager; the GPU's compile tests are "
                    "tests/unit/test_compile.py")
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_attention_fused_path_compiles_in_one_graph(kind, monkeypatch):
    """torch.compile(fullgraph=True) traces the attention modules through fused_rope's autograd.Function and its
    custom ops (rope_fwd in the forward graph, rope_bwd in the backward), with the eager module's numbers."""
    import copy

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "unit"))
    from test_compile import graph_recorder, moetrain_ops_in

    monkeypatch.setattr(R, "fused_rope_runs_here", lambda x, cos: True)
    attn, rope = _attention(kind, F32)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    want = _step(attn, rope, x, dy)
    torch._dynamo.reset()
    graphs = []
    try:
        compiled = torch.compile(copy.deepcopy(attn), fullgraph=True, backend=graph_recorder(graphs))
        got = _step(compiled, rope, x, dy)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    assert {"moetrain.rope_fwd.default", "moetrain.rope_bwd.default"} <= moetrain_ops_in(graphs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-6, atol=1e-6, msg=name)
