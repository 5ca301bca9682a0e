"""moetrain.ops reference path against a naive per-token float64 loop."""

import pytest
import torch
import torch.nn.functional as F

from moetrain import ops


def naive_moe(x, idx, weight, w1, w2, b1=None, b2=None, activation="swiglu"):
    T, K = idx.shape
    out = torch.zeros_like(x)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            if e < 0:
                continue
            h = w1[e] @ x[t] + (b1[e] if b1 is not None else 0)
            a = ops.swiglu(h[None], activation)[0]
            out[t] += weight[t, k].to(x.dtype) * (w2[e] @ a + (b2[e] if b2 is not None else 0))
    return out


def make(T, H, I, E, K, *, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I**0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weight = torch.rand(T, K, generator=g)
    b1 = torch.randn(E, 2 * I, generator=g, dtype=torch.float64) if bias else None
    b2 = torch.randn(E, H, generator=g, dtype=torch.float64) if bias else None
    return x, idx, weight, w1, w2, b1, b2


@pytest.mark.parametrize("T,E,K", [(13, 5, 2), (7, 1, 1), (29, 16, 8), (1, 4, 1)])
def test_moe_experts_matches_naive(T, E, K):
    x, idx, weight, w1, w2, _, _ = make(T, 8, 6, E, K, seed=T * 100 + E)
    got = ops.moe_experts(x, idx, weight, w1, w2, backend="reference")
    want = naive_moe(x, idx, weight, w1, w2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_moe_experts_uneven_empty_single_expert_and_dropped():
    x, idx, weight, w1, w2, _, _ = make(11, 8, 6, 6, 2, seed=3)
    idx[:, 0] = 2  # expert 2 receives every token once; experts may end up empty
    idx[:, 1] = torch.where(torch.arange(11) % 3 == 0, torch.full((11,), -1), torch.full((11,), 4))
    got = ops.moe_experts(x, idx, weight, w1, w2, backend="reference")
    torch.testing.assert_close(got, naive_moe(x, idx, weight, w1, w2), rtol=1e-12, atol=1e-12)


def test_moe_experts_biases_and_clamped_activation():
    x, idx, weight, w1, w2, b1, b2 = make(9, 8, 4, 4, 2, seed=5, bias=True)
    x = x * 6  # push the gate past the clamp limit so the clamp matters
    got = ops.moe_experts(x, idx, weight, w1, w2, b1=b1, b2=b2, activation="swiglu_clamped", backend="reference")
    want = naive_moe(x, idx, weight, w1, w2, b1, b2, activation="swiglu_clamped")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_moe_experts_gradients_match_naive():
    x, idx, weight, w1, w2, b1, b2 = make(10, 6, 4, 5, 3, seed=9, bias=True)
    idx[2, 1] = -1
    weight = weight.double()
    leaves = [t.clone().requires_grad_() for t in (x, weight, w1, w2, b1, b2)]
    got = ops.moe_experts(leaves[0], idx, leaves[1], *leaves[2:4], b1=leaves[4], b2=leaves[5], backend="reference")
    ref_leaves = [t.clone().requires_grad_() for t in (x, weight, w1, w2, b1, b2)]
    want = naive_moe(ref_leaves[0], idx, ref_leaves[1], *ref_leaves[2:4], ref_leaves[4], ref_leaves[5])
    probe = torch.randn_like(want)
    (got * probe).sum().backward()
    (want * probe).sum().backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-10)
    assert leaves[1].grad[2, 1] == 0  # a dropped assignment gets no weight gradient


@pytest.mark.parametrize("change, match", [
    ({"w2": (5, 6, 3)}, r"w2 \(5, 6, 3\) must be \[E, H, I\] = \(5, 6, 4\)"),
    ({"w1": (5, 8, 7)}, r"w1 \(5, 8, 7\) must be \[E, 2I, H\] with H = 6"),
    ({"w1": (5, 7, 6)}, r"w1 \(5, 7, 6\) must be \[E, 2I, H\]"),
    ({"b1": (5, 4)}, r"b1 \(5, 4\) must be \(5, 8\)"),
    ({"b2": (4, 6)}, r"b2 \(4, 6\) must be \(5, 6\)"),
    ({"weight": (10, 2)}, r"topk_idx \(10, 3\) / topk_weight \(10, 2\) must both be \[T, K\]"),
    ({"idx_dtype": torch.int32}, "int64 expert ids"),
])
def test_moe_experts_names_mismatched_operands(change, match):
    x, idx, weight, w1, w2, b1, b2 = make(10, 6, 4, 5, 3, seed=2, bias=True)
    shaped = {name: torch.zeros(change[name], dtype=t.dtype) if name in change else t
              for name, t in (("weight", weight), ("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2))}
    if "idx_dtype" in change:
        idx = idx.to(change["idx_dtype"])
    with pytest.raises(ValueError, match=match):
        ops.moe_experts(x, idx, shaped["weight"], shaped["w1"], shaped["w2"], b1=shaped["b1"], b2=shaped["b2"],
                        backend="reference")


def test_swiglu_formulas():
    h = torch.tensor([[1.0, -2.0, 9.0, 0.5, 3.0, -8.0]])
    g, u = h[:, :3], h[:, 3:]
    torch.testing.assert_close(ops.swiglu(h), F.silu(g) * u)
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    torch.testing.assert_close(ops.swiglu(h, "swiglu_clamped"), gc * torch.sigmoid(1.702 * gc) * (uc + 1))
    with pytest.raises(ValueError, match="unknown expert activation"):
        ops.swiglu(h, "relu")


def test_grouped_gemm_loop_vs_torch_forward_and_trailing_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 8, generator=g)
    w = torch.randn(4, 5, 8, generator=g)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # empty group 1; rows 10, 11 in no group
    y = ops.grouped_gemm(x, w, offs, backend="loop")
    for gi, (s, e) in enumerate([(0, 3), (3, 3), (3, 7), (7, 10)]):
        torch.testing.assert_close(y[s:e], x[s:e] @ w[gi].T)
    assert torch.equal(y[10:], torch.zeros(2, 5))
    y_torch = ops.grouped_gemm(x, w, offs, backend="torch")
    torch.testing.assert_close(y_torch[:10], y[:10])


def test_backend_names():
    assert ops.resolve_backend("auto", torch.device("cpu")) == "loop"
    assert ops.resolve_backend("reference", torch.device("cpu")) == "loop"
    with pytest.raises(ValueError, match="valid"):
        ops.resolve_backend("cutlass", torch.device("cpu"))


@pytest.mark.parametrize("align", [1, 4, 16])
def test_permute_aligned_groups_and_unpermute(align):
    g = torch.Generator().manual_seed(align)
    T, K, E, H = 23, 3, 5, 6
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[:, 0] = torch.where(torch.arange(T) % 4 == 0, 1, idx[:, 0])  # uneven groups
    idx[idx == 3] = -1  # expert 3 empty, its assignments dropped
    weight = torch.rand(T, K, generator=g, dtype=torch.float64)
    x_perm, offs, row_map = ops.permute(x, idx, E, align=align)
    assert x_perm.shape[0] == T * K + E * (align - 1) == row_map.shape[0]
    starts = [0] + offs[:-1].tolist()
    assert all(s % align == 0 for s in starts) and offs[-1] <= x_perm.shape[0]
    flat = torch.where(idx < 0, E - 1, idx).reshape(-1)  # dropped ride with the last expert
    for e, (s, end) in enumerate(zip(starts, offs.tolist())):
        rows = row_map[s:end]
        real = rows[rows >= 0]
        assert sorted(real.tolist()) == sorted(torch.nonzero(flat == e).flatten().tolist())
        assert end - s == -(-real.numel() // align) * align  # padded up to the next multiple only
        torch.testing.assert_close(x_perm[s:end][rows >= 0], x[real // K])
    assert torch.all(x_perm[row_map < 0] == 0)
    # grouped GEMM over the padded layout, then the combine back to tokens
    w = torch.randn(E, 4, H, generator=g, dtype=torch.float64)
    y = ops.grouped_gemm(x_perm, w, offs, backend="loop")
    want = torch.zeros(T, 4, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            if idx[t, k] >= 0:
                want[t] += weight[t, k] * (w[idx[t, k]] @ x[t])
    torch.testing.assert_close(ops.unpermute(y, row_map, idx, weight), want)


def test_swiglu_with_probs_scales_rows_and_differentiates_them():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(6, generator=g, dtype=torch.float64, requires_grad=True)
    got = ops.swiglu(h, probs=probs)
    gate, up = h.chunk(2, dim=-1)
    want = F.silu(gate) * up * probs.unsqueeze(1)
    torch.testing.assert_close(got, want)
    da = torch.randn(6, 4, generator=g, dtype=torch.float64)
    gh, gp = torch.autograd.grad(got, (h, probs), da)
    wh, wp = torch.autograd.grad(want, (h, probs), da)
    torch.testing.assert_close(gh, wh)
    torch.testing.assert_close(gp, wp)
