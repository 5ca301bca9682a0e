"""The fused loss's Triton kernels (``kernels.cross_entropy``) against the PyTorch path of ``ops.linear_cross_entropy``
(``_chunk_torch``, the reference), then the whole op through the kernels against the whole op through PyTorch.

Kernels: the statistics (row max m, sum of exp(z - m), the label's logit), the gradient written over the logits from
a given lse, and the fused kernel doing both, in fp32, bf16 and fp16, on rows longer than one block and V not a
multiple of it (a row whose max sits in its last block: the running sum is rescaled), labels at 0 and V - 1, ignored
rows (not read: m = 0, s = 1, zt = 0, zero gradient rows), labels outside this rank's rows (vocab_start > 0: valid,
not held), an all-ignored chunk, and a vocabulary split over two "ranks" whose statistics are combined as the
vocab-parallel path does (``combine_stats``) between the statistics and the gradient kernels.

Bounds: m exact (a max); s, lse and the loss within 2e-6 relative (fp32 sums in another order; on a GPU Triton's fp32
exp is an approximate exp2, within a few fp32 ulps); fp32 gradients within 2e-6 of the row's largest gradient plus
2e-6 relative; 16-bit gradients within one ulp of their dtype at the reference's value (both round the same fp32
value up to a few fp32 ulps, so a value near a rounding boundary may round the other way).

On the CPU the kernels run in Triton's interpreter with blocks of 16 (V = 100: seven blocks, the last of four) and
the op is forced through them by replacing ``kernels_run_here``; on a GPU at the default block (V = 10000 and Qwen3's
151936: partial last blocks) and the op takes the kernels by itself.
"""

import importlib

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels import cross_entropy as ce  # noqa: E402

lce = importlib.import_module("moetrain.ops.linear_cross_entropy")  # the package re-exports the function's name

DEVICE = "cuda" if ON_GPU else "cpu"
BLOCK = None if ON_GPU else 16
VOCABS = [10000, 151936] if ON_GPU else [100]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
IGNORE = -100
REL = 2e-6


def _logits(C, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(C, V, generator=g) * 4
    z[1] = torch.linspace(-20, 20, V)  # the max in the last block: the running sum is rescaled at every block
    return z.to(dtype).to(DEVICE)


def _labels(C, V, vocab_start=0, seed=0):
    """Rows: 0 -> label 0, 1 -> V - 1, 2 and 5 ignored, 3 below this rank's rows, 4 above them (both only where
    vocab_start > 0), the rest random held labels (global ids)."""
    g = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(0, V, (C,), generator=g)
    labels[0], labels[1], labels[2], labels[5] = 0, V - 1, IGNORE, IGNORE
    labels = labels + vocab_start
    labels[2] = labels[5] = IGNORE
    if vocab_start > 0:
        labels[3], labels[4] = vocab_start - 1, vocab_start + V + 3
    return labels.to(DEVICE)


def _masks(labels, V, vocab_start):
    valid = labels != IGNORE
    local = labels - vocab_start
    return valid, local, valid & (local >= 0) & (local < V)


def _reference(z, labels, vocab_start):
    """(m, s, zt, lse, g): the statistics in fp32 from z, and the PyTorch path's gradient (``_chunk_torch``)."""
    valid, local, holds = _masks(labels, z.shape[1], vocab_start)
    zf = z.float()
    m = zf.amax(1)
    s = torch.exp(zf - m[:, None]).sum(1)
    zt = torch.where(holds, zf.gather(1, torch.where(holds, local, 0)[:, None]).squeeze(1), 0)
    g = lce._chunk_torch(z.clone(), local, valid, holds, None, True)[2]
    return m, s, zt, m + torch.log(s), g


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at each value of x (fp32), the smallest normal's below it."""
    info = torch.finfo(dtype)
    _, e = torch.frexp(x.float().abs().clamp_min(info.tiny))
    return torch.ldexp(torch.full_like(x, info.eps, dtype=F32), e - 1)


def _check_grad(got, want, what=""):
    assert got.dtype == want.dtype and torch.isfinite(got).all(), what
    diff = (got.float() - want.float()).abs()
    if got.dtype == F32:
        bound = REL * want.abs().amax(1, keepdim=True) + REL * want.abs()
    else:
        bound = _ulp(want.float(), got.dtype)
    assert torch.all(diff <= bound), (what, (diff / bound.clamp_min(1e-30)).max().item())


def _close(got, want, what=""):
    assert torch.all((got - want).abs() <= REL * want.abs() + 1e-30), (what, (got - want).abs().max().item())


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("vocab_start", [0, 37])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_stats_then_grad_match_the_reference(dtype, vocab_start, V):
    C = 12
    z, labels = _logits(C, V, dtype), _labels(C, V, vocab_start)
    m, s, zt, lse, g = _reference(z, labels, vocab_start)
    valid = labels != IGNORE
    got_m, got_s, got_zt = ce.row_stats(z, labels, IGNORE, vocab_start, block=BLOCK)
    assert torch.equal(got_m[valid], m[valid])
    _close(got_s[valid], s[valid], "s")
    assert torch.equal(got_zt, zt)  # an exact pick, 0 where not held (rows 3 and 4 with vocab_start > 0)
    # ignored rows are not read
    assert torch.equal(got_m[~valid], torch.zeros_like(m[~valid])) and torch.equal(got_s[~valid], 1 + 0 * s[~valid])
    got_lse = got_m + torch.log(got_s)
    _close(got_lse[valid], lse[valid], "lse")
    z_before = z.clone()
    ce.row_grad(z, labels, torch.where(valid, lse, 0), IGNORE, vocab_start, block=BLOCK)
    _check_grad(z, g, "grad")
    assert not z[~valid].any()
    assert not torch.equal(z, z_before)


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("vocab_start", [0, 37])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
def test_fused_matches_the_reference_and_the_two_kernels(dtype, vocab_start, V):
    C = 12
    z, labels = _logits(C, V, dtype, seed=2), _labels(C, V, vocab_start, seed=2)
    m, s, zt, lse, g = _reference(z, labels, vocab_start)
    valid = labels != IGNORE
    two = z.clone()
    got_m, got_s, _ = ce.row_stats(two, labels, IGNORE, vocab_start, block=BLOCK)
    got_lse, got_zt = ce.row_fused(z, labels, IGNORE, vocab_start, block=BLOCK)
    _close(got_lse[valid], lse[valid], "lse")
    assert torch.equal(got_lse[~valid], torch.zeros_like(lse[~valid]))
    assert torch.equal(got_zt, zt)
    _check_grad(z, g, "fused grad")
    ce.row_grad(two, labels, got_m + torch.log(got_s), IGNORE, vocab_start, block=BLOCK)
    assert torch.equal(z, two)  # the same lse (same code), the same softmax: the same bits
    loss = torch.where(valid, got_lse - got_zt, 0).sum()
    want = torch.where(valid, lse - zt, 0).sum()
    assert abs(loss.item() - want.item()) <= REL * abs(want.item())


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_vocab_split_over_two_ranks_combines_to_the_whole(dtype):
    """Rows [0, V1) on "rank" 0 and [V1, V) on "rank" 1: each one's statistics, combined as the vocab-parallel path
    combines the gathered ones, then each one's gradient from the global lse: together the whole vocabulary's."""
    C, V = 12, VOCABS[0]
    V1 = V // 3 + 5
    z, labels = _logits(C, V, dtype, seed=3), _labels(C, V, seed=3)
    _, _, zt, lse, g = _reference(z, labels, 0)
    valid = labels != IGNORE
    parts = [z[:, :V1].contiguous(), z[:, V1:].contiguous()]
    starts = [0, V1]
    stats = []
    for part, start in zip(parts, starts):
        m, s, zt_r = ce.row_stats(part, labels, IGNORE, start, block=BLOCK)
        holds = _masks(labels, part.shape[1], start)[2]
        stats.append(torch.stack([m, s, zt_r, holds.float()]))
    got_lse, got_zt, held_by = lce.combine_stats(torch.stack(stats))
    _close(got_lse[valid], lse[valid], "lse")
    assert torch.equal(got_zt, zt) and torch.equal(held_by, valid.float())  # each label held by exactly one rank
    for part, start in zip(parts, starts):
        ce.row_grad(part, labels, got_lse, IGNORE, start, block=BLOCK)
    _check_grad(torch.cat(parts, 1), g, "split grad")


def test_all_ignored_chunk():
    C, V = 6, VOCABS[0]
    z = _logits(C, V, BF16, seed=4)
    labels = torch.full((C,), IGNORE, device=DEVICE)
    m, s, zt = ce.row_stats(z, labels, IGNORE, 0, block=BLOCK)
    assert not m.any() and torch.equal(s, torch.ones_like(s)) and not zt.any()
    lse, zt = ce.row_fused(z, labels, IGNORE, 0, block=BLOCK)
    assert not lse.any() and not zt.any() and not z.any()


def test_arguments_the_kernels_do_not_take():
    z, labels = _logits(4, 8, F32), _labels(8, 8)[:4]
    with pytest.raises(ValueError, match="fp64 stays on the PyTorch path"):
        ce.row_stats(z.double(), labels, IGNORE, 0)
    with pytest.raises(ValueError, match="unit column stride"):
        ce.row_stats(z.t(), labels, IGNORE, 0)
    with pytest.raises(ValueError, match="labels \\[C\\] int64"):
        ce.row_stats(z, labels.int(), IGNORE, 0)
    with pytest.raises(ValueError, match="lse must be fp32"):
        ce.row_grad(z, labels, torch.zeros(4, dtype=torch.float64, device=DEVICE), IGNORE, 0)


# ---- the op through the kernels --------------------------------------------------------------------------------


def _inputs(T, V, H, dtype, seed=0, ignored=0.2):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(V, H, generator=g) * H**-0.5 * 3).to(dtype).to(DEVICE)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < ignored] = IGNORE
    labels[0], labels[-1] = 0, V - 1
    return h, w, labels.to(DEVICE)


def _op(h, w, labels, kernels: bool, monkeypatch, grad=True, **kw):
    """(loss_sum, count, dh, dW) of the op with the kernels on or off (dh, dW None without ``grad``)."""
    monkeypatch.setattr(lce, "kernels_run_here", (lambda x: x.dtype in lce.KERNEL_DTYPES) if kernels
                        else (lambda x: False))
    h, w = h.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
    loss, count = lce.linear_cross_entropy(h, w, labels, **kw)
    if grad:
        (loss * 0.37).backward()
    return loss.detach(), count, h.grad, w.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("chunk", [7, None])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_op_through_the_kernels_equals_the_pytorch_path(dtype, chunk, monkeypatch):
    """Uneven chunks of 7 tokens, and the default chunk (the kernels' is 3x PyTorch's for bf16: one chunk here)."""
    T, V, H = 30, VOCABS[0], 16
    h, w, labels = _inputs(T, V, H, dtype)
    want = _op(h, w, labels, False, monkeypatch, chunk_tokens=chunk)
    got = _op(h, w, labels, True, monkeypatch, chunk_tokens=chunk)
    assert got[0].dtype == F32 and int(got[1]) == int(want[1])
    assert abs(got[0].item() - want[0].item()) <= REL * abs(want[0].item())
    # fp32: the same gradients to fp32 rounding; bf16: a gradient element one ulp off here and there, then GEMMs
    for a, b in zip(got[2:], want[2:]):
        assert a.dtype == dtype and _rel(a, b) < (1e-6 if dtype == F32 else 2e-3)


def test_op_without_grad_all_ignored_and_a_bad_label(monkeypatch):
    T, V, H = 20, VOCABS[0], 8
    h, w, labels = _inputs(T, V, H, BF16, seed=5)
    want = _op(h, w, labels, False, monkeypatch, grad=False, chunk_tokens=6)
    got = _op(h, w, labels, True, monkeypatch, grad=False, chunk_tokens=6)  # the statistics kernel alone
    assert abs(got[0].item() - want[0].item()) <= REL * abs(want[0].item())
    ignored = torch.full_like(labels, IGNORE)
    loss, count, dh, dw = _op(h, w, ignored, True, monkeypatch, chunk_tokens=6)
    assert loss.item() == 0.0 and int(count) == 0 and not dh.any() and not dw.any()
    wrong = labels.clone()
    wrong[3] = V + 4  # no rank holds it: NaN, no host sync, no out-of-bounds read
    loss, count, dh, _ = _op(h, w, wrong, True, monkeypatch, chunk_tokens=6, check_labels=False)
    assert torch.isnan(loss) and torch.isfinite(dh).all()


def test_default_chunk_follows_the_path(monkeypatch):
    h, w, labels = _inputs(8, VOCABS[0], 8, BF16)
    seen = []
    real = lce.linear_cross_entropy_pass
    monkeypatch.setattr(lce, "linear_cross_entropy_pass", lambda *a: seen.append(a[3]) or real(*a))
    for kernels in (False, True):
        _op(h, w, labels, kernels, monkeypatch, grad=False)
    V = w.shape[0]
    assert seen == [lce.default_chunk_tokens(V, BF16), 3 * lce.default_chunk_tokens(V, BF16)]


# ---- the custom ops --------------------------------------------------------------------------------------------


def _op_samples():
    z, labels = _logits(6, VOCABS[0], BF16, seed=6), _labels(6, VOCABS[0], 0, seed=6)
    lse = torch.randn(6, device=DEVICE)
    return [(lce.cross_entropy_stats, (z, labels, IGNORE, 0)),
            (lce.cross_entropy_stats, (z.float(), labels, IGNORE, 3)),
            (lce.cross_entropy_grad, (z.clone(), labels, lse, IGNORE, 0)),
            (lce.cross_entropy_fused, (z.clone(), labels, IGNORE, 0)),
            (lce.cross_entropy_fused, (z.float(), labels, IGNORE, 5))]


@pytest.mark.parametrize("i", range(5))
def test_opcheck(i):
    call, args = _op_samples()[i]
    torch.library.opcheck(call.op, args)


def test_fake_outputs_match_the_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for call, args in _op_samples():
        real = call.impl(*args)
        with FakeTensorMode() as mode:
            fake = call.op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        if real is None:
            assert fake is None
            continue
        assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]
