"""GPU checks of the warp-specialized ping-pong forward / data gradient (kernels/rowgroup_pingpong.py, Gluon;
marked gpu, skipped without a Hopper GPU): bf16 against float64 per group on skewed routing with empty groups, partial
tiles over rows, columns and the reduction, and trailing rows past offs[-1] (written as zeros); every output written
(NaN-poisoned first); against torch._grouped_mm at the layers' routed shapes (fewer experts, same rows per expert).
A hang here is a barrier-phase bug: the device scripts run this file under a timeout."""

import pytest
import torch

from kernel_checks import check_graph_replays, check_groups_fp64, hopper_kernels, rel_err, rows_fp64, skewed_offs_cuda

pytestmark = pytest.mark.gpu
pytest.importorskip("triton", reason="the triton package is not installed")


def kernel():
    return hopper_kernels("rowgroup_pingpong")


M, G, N, K = 9000, 24, 768 + 72, 1024 + 8  # partial tiles over N and K


@pytest.mark.parametrize("dgrad", [False, True])
@pytest.mark.parametrize("tile, stages, group_m, programs", [((128, 128), 4, 8, None), ((128, 128), 5, 1, 7),
                                                             ((64, 256), 3, 8, None), ((64, 256), 4, 4, 3)])
def test_matches_float64_on_skewed_routing(dgrad, tile, stages, group_m, programs):
    rp = kernel()
    offs = skewed_offs_cuda(M, G, seed=21)  # empty groups; the last 37 rows belong to no group
    torch.manual_seed(22)
    a = torch.randn(M, N if dgrad else K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16)
    width = K if dgrad else N
    got = rp.grouped_gemm_rowgroup_pingpong(a, w, offs, dgrad=dgrad, stages=stages, group_m=group_m, tile=tile,
                                            num_programs=programs,
                                            out=torch.full((M, width), float("nan"), device="cuda",
                                                           dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) outputs"
    end = int(offs[-1])
    assert end < M and torch.equal(got[end:], torch.zeros_like(got[end:])), "rows past offs[-1] must be zeros"
    check_groups_fp64("dgrad" if dgrad else "fwd", got, a, w, offs, range(G))


@pytest.mark.parametrize("dgrad", [False, True])
def test_one_group_with_every_row_and_single_rows(dgrad):
    rp = kernel()
    torch.manual_seed(23)
    m, g, n, k = 1000, 5, 256, 192
    a = torch.randn(m, n if dgrad else k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    for ends in ([0, 0, m, m, m], [1, 2, 3, 4, m], [m, m, m, m, m]):
        offs = torch.tensor(ends, device="cuda", dtype=torch.int32)
        got = rp.grouped_gemm_rowgroup_pingpong(a, w, offs, dgrad=dgrad,
                                                out=torch.full((m, k if dgrad else n), float("nan"), device="cuda",
                                                               dtype=torch.bfloat16))
        torch.cuda.synchronize()
        assert not torch.isnan(got).any(), ends
        check_groups_fp64("dgrad" if dgrad else "fwd", got, a, w, offs, range(g))


@pytest.mark.parametrize("m, g, n, k", [(65536 // 32, 8, 4096, 7168), (131072 // 16, 8, 2048, 768),
                                        (65536, 4, 5760, 2880)])
@pytest.mark.parametrize("dgrad", [False, True])
def test_matches_torch_at_the_layer_shapes(m, g, n, k, dgrad):
    rp = kernel()
    torch.manual_seed(24)
    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)
    a = torch.randn(m, n if dgrad else k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    want = torch._grouped_mm(a, w if dgrad else w.transpose(-2, -1), offs=offs)
    got = rp.grouped_gemm_rowgroup_pingpong(a, w, offs, dgrad=dgrad)
    assert rel_err(got, want) < 1e-2


def test_refuses_what_it_cannot_run():
    rp = kernel()
    a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([32, 64], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="columns"):
        rp.grouped_gemm_rowgroup_pingpong(a, w, offs, dgrad=True)
    with pytest.raises(ValueError, match="tile"):
        rp.grouped_gemm_rowgroup_pingpong(a, w, offs, tile=(256, 128))
    with pytest.raises(ValueError, match="bf16"):
        rp.grouped_gemm_rowgroup_pingpong(a.float(), w.float(), offs)
    with pytest.raises(ValueError, match="out must be"):
        rp.grouped_gemm_rowgroup_pingpong(a, w, offs, out=torch.empty(64, 32, device="cuda", dtype=torch.bfloat16))


def swiglu_bwd_fp64(dy, w, offs, h, probs, activation):
    """(dh, dprobs) in float64: FC2's data gradient per group, then SwiGLU's backward with the row factors."""
    from moetrain.ops import moe_rows

    da = rows_fp64("dgrad", dy, w, offs)
    hd = h.double()
    dprobs = None if probs is None else (da * moe_rows.swiglu_torch(hd, activation)).sum(1)
    scaled = da if probs is None else da * probs.double()[:, None]
    return moe_rows.swiglu_bwd_torch(hd, scaled, activation), dprobs


@pytest.mark.parametrize("activation, with_probs, programs", [("swiglu", True, None), ("swiglu", False, 5),
                                                                ("swiglu_clamped", True, None)])
def test_dgrad_with_swiglu_backward_matches_float64(activation, with_probs, programs):
    rp = kernel()
    m, g, hid, inter = 6000, 16, 512 + 64, 384 + 40  # I not a multiple of the 128-column tile
    offs = skewed_offs_cuda(m, g, seed=31)  # empty groups, 37 trailing rows past offs[-1]
    torch.manual_seed(32)
    dy = torch.randn(m, hid, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(g, hid, inter, device="cuda") / hid ** 0.5).to(torch.bfloat16)
    scale = 4.0 if activation == "swiglu_clamped" else 1.0  # past the clamp (7) often enough to matter
    h = (torch.randn(m, 2 * inter, device="cuda") * scale).to(torch.bfloat16)
    probs = torch.rand(m, device="cuda") if with_probs else None
    dh, dprobs = rp.grouped_gemm_dgrad_swiglu_pingpong(dy, w, offs, h, probs, activation, num_programs=programs)
    torch.cuda.synchronize()
    want_dh, want_dprobs = swiglu_bwd_fp64(dy, w, offs, h, probs, activation)
    end = int(offs[-1])
    assert torch.equal(dh[end:], torch.zeros_like(dh[end:])), "rows past offs[-1] must be zeros"
    assert rel_err(dh[:end], want_dh[:end]) < 1e-2
    if with_probs:
        assert torch.equal(dprobs[end:], torch.zeros_like(dprobs[end:]))
        assert rel_err(dprobs[:end], want_dprobs[:end]) < 1e-2
    else:
        assert dprobs is None


def test_dgrad_with_swiglu_backward_matches_the_separate_kernels_at_qwen3_fc2():
    """Against the path it replaces: FC2's data gradient (bf16 da), then the SwiGLU backward kernel."""
    rp = kernel()
    from moetrain.kernels import grouped_gemm, moe_rows

    m, g, hid, inter = 131072 // 16, 8, 2048, 768
    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)
    torch.manual_seed(33)
    dy = torch.randn(m, hid, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(g, hid, inter, device="cuda") / hid ** 0.5).to(torch.bfloat16)
    h = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(m, device="cuda")
    dh, dprobs = rp.grouped_gemm_dgrad_swiglu_pingpong(dy, w, offs, h, probs)
    da = grouped_gemm.grouped_gemm_dgrad(dy, w, offs)
    want_dh, want_dprobs = moe_rows.swiglu_bwd(h, da, "swiglu", probs)
    assert rel_err(dh, want_dh) < 1e-2
    assert rel_err(dprobs, want_dprobs) < 1e-2


@pytest.mark.parametrize("dgrad", [False, True])
def test_in_a_cuda_graph_with_new_routing(dgrad):
    # the programs find their groups on the device (tile total and cursor): one capture, replayed on new routings
    rp = kernel()
    m, g, n, k = 8192, 32, 1024, 512
    torch.manual_seed(34)
    a = torch.randn(m, n if dgrad else k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    offs = skewed_offs_cuda(m, g, seed=1)
    out = torch.empty(m, k if dgrad else n, device="cuda", dtype=torch.bfloat16)

    def check():
        assert not torch.isnan(out).any()
        check_groups_fp64("dgrad" if dgrad else "fwd", out, a, w, offs, range(g))

    check_graph_replays(lambda: rp.grouped_gemm_rowgroup_pingpong(a, w, offs, dgrad=dgrad, out=out), offs, m, (out,),
                        check)


def fc1_swiglu_fp64(x, w, offs, probs, activation):
    """(h, a) in float64: FC1 per group, then the activation of h rounded to bf16 (as the kernel and the separate
    SwiGLU kernel read it), times the row factors."""
    from moetrain.ops import moe_rows

    h = rows_fp64("fwd", x, w, offs)
    a = moe_rows.swiglu_torch(h.to(torch.bfloat16).double(), activation)
    return h, a if probs is None else a * probs.double()[:, None]


@pytest.mark.parametrize("activation, with_probs, programs", [("swiglu", True, None), ("swiglu", False, 5),
                                                                ("swiglu_clamped", True, None)])
def test_fc1_with_swiglu_matches_float64(activation, with_probs, programs):
    rp = kernel()
    m, g, hid, inter = 6000, 16, 512 + 72, 384 + 40  # I not a multiple of the 64-column tile, H of the 64-step
    offs = skewed_offs_cuda(m, g, seed=41)  # empty groups, 37 trailing rows past offs[-1]
    torch.manual_seed(42)
    scale = 4.0 if activation == "swiglu_clamped" else 1.0  # past the clamp (7) often enough to matter
    x = (torch.randn(m, hid, device="cuda") * scale).to(torch.bfloat16)
    w = (torch.randn(g, 2 * inter, hid, device="cuda") / hid ** 0.5).to(torch.bfloat16)
    probs = torch.rand(m, device="cuda") if with_probs else None
    h, a = rp.grouped_gemm_fc1_swiglu_pingpong(x, w, offs, probs, activation, num_programs=programs)
    torch.cuda.synchronize()
    want_h, want_a = fc1_swiglu_fp64(x, w, offs, probs, activation)
    end = int(offs[-1])
    for got in (h, a):
        assert not torch.isnan(got).any()
        assert torch.equal(got[end:], torch.zeros_like(got[end:])), "rows past offs[-1] must be zeros"
    assert rel_err(h[:end], want_h[:end]) < 1e-2
    assert rel_err(a[:end], want_a[:end]) < 1e-2


def test_fc1_with_swiglu_matches_the_separate_kernels_at_qwen3_fc1():
    """Against the path it replaces: the ping-pong forward (h), then the SwiGLU kernel on that h."""
    rp = kernel()
    from moetrain.kernels import moe_rows

    m, g, hid, inter = 131072 // 16, 8, 2048, 768
    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)
    torch.manual_seed(43)
    x = torch.randn(m, hid, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(g, 2 * inter, hid, device="cuda") / hid ** 0.5).to(torch.bfloat16)
    probs = torch.rand(m, device="cuda")
    h, a = rp.grouped_gemm_fc1_swiglu_pingpong(x, w, offs, probs)
    want_h = rp.grouped_gemm_rowgroup_pingpong(x, w, offs)
    assert rel_err(h, want_h) < 1e-3
    assert rel_err(a, moe_rows.swiglu_fwd(h, "swiglu", probs)) < 1e-3


def test_fc1_with_swiglu_refuses_what_it_cannot_run():
    rp = kernel()
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([32, 64], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 8"):
        rp.grouped_gemm_fc1_swiglu_pingpong(x, torch.randn(2, 2 * 12, 128, device="cuda", dtype=torch.bfloat16), offs)
    w = torch.randn(2, 2 * 64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="probs"):
        rp.grouped_gemm_fc1_swiglu_pingpong(x, w, offs, torch.rand(63, device="cuda"))
    with pytest.raises(ValueError, match="activation"):
        rp.grouped_gemm_fc1_swiglu_pingpong(x, w, offs, None, "gelu")
    with pytest.raises(ValueError, match="stages"):
        rp.grouped_gemm_fc1_swiglu_pingpong(x, w, offs, stages=6)


def test_fc1_with_swiglu_in_a_cuda_graph_with_new_routing():
    rp = kernel()
    m, g, hid, inter = 8192, 32, 512, 256
    torch.manual_seed(44)
    x = torch.randn(m, hid, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(g, 2 * inter, hid, device="cuda") / hid ** 0.5).to(torch.bfloat16)
    probs = torch.rand(m, device="cuda")
    offs = skewed_offs_cuda(m, g, seed=1)
    outs = []

    def step():
        h, a = rp.grouped_gemm_fc1_swiglu_pingpong(x, w, offs, probs)
        outs[:] = [h, a]

    def check():
        want_h, want_a = fc1_swiglu_fp64(x, w, offs, probs, "swiglu")
        end = int(offs[-1])
        assert not any(torch.isnan(t).any() for t in outs)
        assert rel_err(outs[0][:end], want_h[:end]) < 1e-2 and rel_err(outs[1][:end], want_a[:end]) < 1e-2

    check_graph_replays(step, offs, m, outs, check)  # outs: the captured h and a, poisoned before each replay
