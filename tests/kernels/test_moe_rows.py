"""Row kernels of the expert path (moetrain.kernels.moe_rows) against their plain-PyTorch references
(moetrain.ops.moe_rows, the "torch" implementation) and against explicit per-token loops in float64.

Without a GPU the kernels run in Triton's CPU interpreter in float32; on a GPU also in bf16.
Legend: T tokens, K top-k, M = T*K rows, H hidden, I expert intermediate.
"""

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels import moe_rows as kernels  # noqa: E402
from moetrain.ops import moe_rows  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """Every float buffer the kernels allocate starts as NaN, so an unwritten element shows."""
    real_empty = torch.empty

    def poisoned(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(kernels.torch, "empty", poisoned)
    assert torch.isnan(kernels.torch.empty(2)).all()


DTYPES = [torch.float32] + ([torch.bfloat16] if ON_GPU else [])


def routed(T, K, H, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    row_map = torch.randperm(T * K, generator=g)
    y = torch.randn(T * K, H, generator=g, dtype=dtype)
    weight = torch.rand(T, K, generator=g, dtype=dtype)
    dout = torch.randn(T, H, generator=g, dtype=dtype)
    return row_map, moe_rows.inverse_permutation(row_map), y, weight, dout


def loop_combine(y, row_map, weight, T, K):
    out = torch.zeros(T, y.shape[1], dtype=torch.float64)
    for r, a in enumerate(row_map.tolist()):
        out[a // K] += (1.0 if weight is None else weight[a // K, a % K].item()) * y[r].double()
    return out


def close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert not torch.isnan(got).any()
    got, want = got.double().cpu(), want.double().cpu()
    assert ((got - want).norm() / want.norm().clamp_min(1e-30)).item() < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,H", [(5, 1, 7), (13, 2, 24), (9, 8, 1030), (1, 3, 16)])
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_forward_and_backward(dtype, T, K, H, weighted):
    row_map, inverse, y, weight, dout = routed(T, K, H, seed=T * 7 + K + H)
    w = weight if weighted else None
    want = loop_combine(y, row_map, w, T, K)
    for impl in ("torch", "triton"):
        y_leaf = y.to(DEVICE, dtype).requires_grad_()
        w_leaf = w.to(DEVICE, torch.float32).requires_grad_() if weighted else None
        out = moe_rows.combine(y_leaf, inverse.to(DEVICE), w_leaf, K, impl)
        close(out, want, dtype)
        out.backward(dout.to(DEVICE, dtype))
        # d out / d y[r] = weight of row r's assignment times dout of its token
        a = row_map
        scale = weight.reshape(-1)[a].unsqueeze(1) if weighted else torch.ones(T * K, 1, dtype=torch.float64)
        close(y_leaf.grad, scale * dout[a // K], dtype)
        if weighted:
            want_dw = torch.einsum("tkh,th->tk", y[inverse].view(T, K, H), dout)
            close(w_leaf.grad, want_dw, dtype)


def test_combine_triton_writes_every_row_and_rejects_bad_shapes():
    T, K, H = 6, 2, 10
    row_map, inverse, y, weight, dout = routed(T, K, H, seed=1, dtype=torch.float32)
    dy, dweight = kernels.combine_bwd(dout.to(DEVICE), y.to(DEVICE), inverse.to(DEVICE), weight.to(DEVICE))
    assert dy.shape == (T * K, H) and dweight.shape == (T, K) and not torch.isnan(dy).any()
    with pytest.raises(ValueError, match="weight"):
        kernels.combine(y.to(DEVICE), inverse.to(DEVICE), weight.double().to(DEVICE), K)
    with pytest.raises(ValueError, match="multiple of topk"):
        kernels.combine(y[:-1].to(DEVICE), inverse[:-1].to(DEVICE), None, K)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,H", [(5, 1, 7), (13, 2, 24), (9, 8, 1030), (1, 3, 16)])
def test_token_rows_is_the_gather_by_row(dtype, T, K, H):
    # token_rows writes x_perm token by token; every row must equal x[token_of_row] bit for bit (poisoned outputs)
    row_map, inverse, _, _, _ = routed(T, K, H, seed=T * 5 + K + H)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T + H)).to(DEVICE, dtype)
    got = kernels.token_rows(x, inverse.to(DEVICE))
    assert got.dtype == dtype and got.shape == (T * K, H)
    assert torch.equal(got, x[(row_map // K).to(DEVICE)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
@pytest.mark.parametrize("M,I", [(7, 5), (33, 768), (3, 1100)])
def test_swiglu_forward_and_backward(dtype, activation, M, I):
    g = torch.Generator().manual_seed(M + I)
    # past the clamp limits too; the reference sees the same rounded values (a bf16 h near 7 may
    # round onto the other side of the clamp)
    h = (torch.randn(M, 2 * I, generator=g, dtype=torch.float64) * 5).to(dtype).double()
    da = torch.randn(M, I, generator=g, dtype=torch.float64).to(dtype).double()
    ref = h.clone().requires_grad_()
    want = moe_rows.swiglu_torch(ref, activation)
    want.backward(da)
    leaf = h.to(DEVICE, dtype).requires_grad_()
    got = moe_rows.swiglu(leaf, activation, "triton")
    close(got, want.detach(), dtype)
    got.backward(da.to(DEVICE, dtype))
    close(leaf.grad, ref.grad, dtype)


def test_unknown_activation_and_impl_are_errors():
    h = torch.randn(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match="activation"):
        moe_rows.swiglu(h, "gelu", "triton")
    with pytest.raises(ValueError, match="implementation"):
        moe_rows.swiglu(h, "swiglu", "cuda")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_combine_ignores_rows_no_assignment_reads(impl):
    # permute(align > 1) leaves padding rows: the combine skips them and gives them zero gradient
    T, K, H, pad = 6, 2, 12, 5
    row_map, inverse, y, weight, dout = routed(T, K, H, seed=9, dtype=torch.float32)
    spread = torch.randperm(T * K + pad, generator=torch.Generator().manual_seed(1))[: T * K]
    y_pad = torch.randn(T * K + pad, H)
    y_pad[spread] = y
    y_leaf = y_pad.to(DEVICE).requires_grad_()
    w_leaf = weight.to(DEVICE).requires_grad_()
    out = moe_rows.combine(y_leaf, spread[inverse].to(DEVICE), w_leaf, K, impl)
    close(out, loop_combine(y, row_map, weight, T, K), torch.float32)
    out.backward(dout.to(DEVICE))
    unused = torch.ones(T * K + pad, dtype=torch.bool)
    unused[spread] = False
    assert torch.all(y_leaf.grad[unused.to(DEVICE)] == 0)
    close(y_leaf.grad[spread.to(DEVICE)], weight.reshape(-1)[row_map].unsqueeze(1) * dout[row_map // K], torch.float32)


def test_swiglu_tiles_leave_the_fewest_lanes_idle():
    def shape(inter):
        tile = kernels.swiglu_tile(inter)
        return tile.rows, tile.cols, tile.steps

    assert shape(768) == (8, 256, 3)  # Qwen3: 1024 columns idled a quarter of the lanes
    assert shape(2048) == (2, 1024, 2)
    assert shape(14336) == (2, 1024, 14)
    assert shape(2880) == (2, 1024, 3)  # 192 idle at every width: the widest
    assert shape(1100) == (8, 256, 5)
    assert shape(5) == (128, 16, 1)
    assert kernels.swiglu_tile(768).warps == 8


def test_combine_programs_cover_a_token_up_to_4096_columns():
    assert kernels.combine_tile(2048) == kernels.RowTile(1, 2048, 4)
    assert kernels.combine_tile(2880) == kernels.RowTile(1, 4096, 8)
    assert kernels.combine_tile(7168) == kernels.RowTile(1, 4096, 8)
    assert kernels.combine_tile(5) == kernels.RowTile(1, 16, 4)


@pytest.mark.parametrize("tile", [(1, 16, 1, 1), (1, 64, 2, 1), (1, 256, 8, 1)])
def test_combines_give_the_same_bits_on_every_program_shape(tile):
    # the row-kernel sweep's candidates (`moetrain bench rows`) must change the speed only
    T, K, H = 11, 3, 100
    row_map, inverse, y, weight, dout = routed(T, K, H, seed=4, dtype=torch.float32)
    y, inverse, weight, dout = y.to(DEVICE), inverse.to(DEVICE), weight.to(DEVICE), dout.to(DEVICE)
    tile = kernels.RowTile(*tile)
    assert torch.equal(kernels.combine(y, inverse, weight, K, tile=tile), kernels.combine(y, inverse, weight, K))
    assert torch.equal(kernels.token_rows(dout, inverse, tile=tile), kernels.token_rows(dout, inverse))
    got = kernels.combine_bwd(dout, y, inverse, weight, tile=tile)
    want = kernels.combine_bwd(dout, y, inverse, weight)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-5)


# Column steps: one program per row block covering all of I (3 blocks of 16 for I = 40: d probs written directly), two
# of two (the second's second step past I, all masked), and one each (partial sums added after the kernel)
@pytest.mark.parametrize("tile", [(4, 16, 2, 3), (8, 16, 4, 2), (2, 32, 1, 1), (16, 64, 4, 1)])
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
def test_swiglu_gives_the_same_results_on_every_program_shape(tile, activation):
    M, I = 21, 40  # noqa: E741
    g = torch.Generator().manual_seed(7)
    h = (torch.randn(M, 2 * I, generator=g) * 4).to(DEVICE)
    da = torch.randn(M, I, generator=g).to(DEVICE)
    probs = torch.rand(M, generator=g).to(DEVICE)
    tile = kernels.RowTile(*tile)
    assert torch.equal(kernels.swiglu_fwd(h, activation, probs, tile=tile), kernels.swiglu_fwd(h, activation, probs))
    dh, dprobs = kernels.swiglu_bwd(h, da, activation, probs, tile=tile)
    want_dh, want_dprobs = kernels.swiglu_bwd(h, da, activation, probs)
    assert torch.equal(dh, want_dh)
    close(dprobs, (da.double() * moe_rows.swiglu_torch(h.double(), activation)).sum(1), torch.float32)
    close(dprobs, want_dprobs, torch.float32)
    dh_plain, none = kernels.swiglu_bwd(h, da, activation, None, tile=tile)
    assert none is None and torch.equal(dh_plain, kernels.swiglu_bwd(h, da, activation)[0])


def test_bad_program_shapes_are_errors():
    with pytest.raises(ValueError, match="power of two"):
        kernels.RowTile(3, 64)
    with pytest.raises(ValueError, match="steps"):
        kernels.RowTile(1, 64, 4, 0)
    inverse = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="rows=1"):
        kernels.combine(torch.zeros(4, 8, device=DEVICE), inverse, None, 2, tile=kernels.RowTile(2, 16))


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped"])
@pytest.mark.parametrize("M,I", [(7, 5), (9, 1100), (5, 768)])
def test_swiglu_with_row_probabilities(activation, M, I):
    g = torch.Generator().manual_seed(M * I)
    h = torch.randn(M, 2 * I, generator=g, dtype=torch.float64) * 3
    probs = torch.rand(M, generator=g, dtype=torch.float64)
    da = torch.randn(M, I, generator=g, dtype=torch.float64)
    ref_h, ref_p = h.clone().requires_grad_(), probs.clone().requires_grad_()
    want = moe_rows.swiglu_torch(ref_h, activation) * ref_p.unsqueeze(1)  # the definition, in fp64
    want.backward(da)
    for impl in ("torch", "triton"):
        leaf_h = h.to(DEVICE, torch.float32).requires_grad_()
        leaf_p = probs.to(DEVICE, torch.float32).requires_grad_()
        got = moe_rows.swiglu(leaf_h, activation, impl, probs=leaf_p)
        close(got, want.detach(), torch.float32)
        got.backward(da.to(DEVICE, torch.float32))
        close(leaf_h.grad, ref_h.grad, torch.float32)
        close(leaf_p.grad, ref_p.grad, torch.float32)
