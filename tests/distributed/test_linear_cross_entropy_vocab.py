"""ops.linear_cross_entropy vocab-parallel on 2 gloo ranks: each rank holds a contiguous block of the vocabulary's
rows (an uneven split, 19 + 18 of 37); loss_sum, count and dh (whole on every rank) equal the one-rank result and each
rank's dW its rows of the one-rank dW, fp64 to 1e-12 and fp32 to 1e-6; grad-free calls, a label no rank holds
(ValueError on every rank, or NaN unchecked), torch.compile(fullgraph=True) with the group, and the Triton kernels'
vocab-parallel path (statistics kernel, all-gather, gradient kernel) under the CPU interpreter."""

import torch
from gloo_ranks import run_ranks

from moetrain.ops import linear_cross_entropy, linear_cross_entropy_reference

T, V, H = 29, 37, 8
ROWS = (19, 18)  # rank r holds rows [sum(ROWS[:r]), sum(ROWS[:r + 1]))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(dtype):
    g = torch.Generator().manual_seed(7)
    h = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::5] = -100
    labels[1], labels[2] = 0, V - 1  # the first and last rows: one on each rank
    return h, w, labels


def _run(h, w, labels, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, count = linear_cross_entropy(h, w, labels, **kw)
    (loss * 0.3).backward()
    return loss.detach(), count, h.grad, w.grad


def _vocab_parallel(rank, world_size, dtype_name, tol):
    import pytest
    import torch.distributed as dist

    group, dtype = dist.group.WORLD, getattr(torch, dtype_name)
    start = sum(ROWS[:rank])
    rows = slice(start, start + ROWS[rank])
    h, w, labels = _inputs(dtype)
    want = _run(h, w, labels, chunk_tokens=6)
    got = _run(h, w[rows], labels, chunk_tokens=6, vocab_group=group, vocab_start=start)
    assert int(got[1]) == int(want[1]) == int((labels != -100).sum())
    assert rel(got[0], want[0]) < tol and rel(got[2], want[2]) < tol and rel(got[3], want[3][rows]) < tol
    if dtype == torch.float64:  # and the plain reference
        ref_h = h.clone().requires_grad_()
        linear_cross_entropy_reference(ref_h, w, labels)[0].mul(0.3).backward()
        assert rel(got[2], ref_h.grad) < 1e-10
    with torch.no_grad():
        loss, _ = linear_cross_entropy(h, w[rows], labels, chunk_tokens=4, vocab_group=group, vocab_start=start)
    assert rel(loss, want[0]) < tol

    bad = labels.clone()
    bad[3] = V  # past every rank's rows
    with pytest.raises(ValueError, match="label 37 of token 3 .* no rank of vocab_group holds it"):
        linear_cross_entropy(h, w[rows], bad, chunk_tokens=6, vocab_group=group, vocab_start=start)
    loss, _ = linear_cross_entropy(h, w[rows], bad, vocab_group=group, vocab_start=start, check_labels=False)
    assert torch.isnan(loss)


def test_vocab_parallel_fp64_equals_one_rank():
    run_ranks(_vocab_parallel, "float64", 1e-12)


def test_vocab_parallel_fp32_equals_one_rank():
    run_ranks(_vocab_parallel, "float32", 1e-6)


def _compiled(rank, world_size):
    import torch.distributed as dist

    group, start = dist.group.WORLD, sum(ROWS[:rank])
    rows = slice(start, start + ROWS[rank])
    h, w, labels = _inputs(torch.float64)

    def step(a, b):
        loss, count = linear_cross_entropy(a, b, labels, chunk_tokens=8, vocab_group=group, vocab_start=start)
        return loss / count

    want = _run(h, w, labels, chunk_tokens=8)
    torch._dynamo.reset()
    a, b = h.clone().requires_grad_(), w[rows].clone().requires_grad_()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(a, b)
    (loss * int(want[1])).mul(0.3).backward()
    assert rel(loss * int(want[1]), want[0]) < 1e-12
    assert rel(a.grad, want[2]) < 1e-12 and rel(b.grad, want[3][rows]) < 1e-12


def test_vocab_parallel_compiles_fullgraph():
    run_ranks(_compiled)


def _through_the_kernels(rank, world_size, dtype_name, tol):
    """The Triton kernels (kernels.cross_entropy) on the CPU interpreter (TRITON_INTERPRET from the parent): the
    statistics kernel, the all-gather, the gradient kernel; against one rank through the fused kernel, and against
    one rank's PyTorch path."""
    import importlib

    import torch.distributed as dist

    lce = importlib.import_module("moetrain.ops.linear_cross_entropy")
    torch_path = lce.kernels_run_here
    lce.kernels_run_here = lambda x: x.dtype in lce.KERNEL_DTYPES
    group, dtype = dist.group.WORLD, getattr(torch, dtype_name)
    start = sum(ROWS[:rank])
    rows = slice(start, start + ROWS[rank])
    h, w, labels = _inputs(dtype)
    got = _run(h, w[rows], labels, chunk_tokens=6, vocab_group=group, vocab_start=start)
    one = _run(h, w, labels, chunk_tokens=6)
    lce.kernels_run_here = torch_path
    want = _run(h, w, labels, chunk_tokens=6)
    for ref in (one, want):
        assert int(got[1]) == int(ref[1])
        assert rel(got[0], ref[0]) < 1e-6 and rel(got[2], ref[2]) < tol and rel(got[3], ref[3][rows]) < tol


def test_vocab_parallel_through_the_kernels(monkeypatch):
    import pytest

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import triton afresh
    # bf16: dh is the sum of the ranks' bf16 partial products, each rounded (2.8e-3 relative here)
    for dtype_name, tol in (("float32", 1e-6), ("bfloat16", 1e-2)):
        run_ranks(_through_the_kernels, dtype_name, tol)
