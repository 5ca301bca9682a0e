"""ops.linear_cross_entropy against the plain reference (logits in fp32/fp64, F.cross_entropy summed): values and
gradients (dh, dW) for fp64, fp32 and bf16 inputs, uneven and one-token chunks, ignored and all-ignored labels, a tied
head, gradient accumulation, grad-free calls, label errors, the bytes kept for backward against the unfused path's,
and torch.compile(fullgraph=True). The vocab-parallel case is tests/distributed/test_linear_cross_entropy_vocab.py."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetrain.models.transformer import cross_entropy
from moetrain.ops import linear_cross_entropy, linear_cross_entropy_mean, linear_cross_entropy_reference
from moetrain.ops.linear_cross_entropy import default_chunk_tokens


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def inputs(T, V, H, dtype, seed=0, ignored=0.2):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * H**-0.5 * 3).to(dtype)  # logits of a few units
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < ignored] = -100
    return h, w, labels


def loss_and_grads(fn, h, w, labels, scale=0.37, **kw):
    """(loss_sum, count, dh, dW) of fn, with loss_sum's incoming gradient ``scale`` (the caller's 1 / count)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, count = fn(h, w, labels, **kw)
    (loss * scale).backward()
    return loss.detach(), count, h.grad, w.grad


CASES = [(37, 23, 16, 5), (9, 11, 8, 1), (64, 50, 12, None), (130, 300, 24, 64)]  # uneven, one-token, one chunk


@pytest.mark.parametrize("T,V,H,chunk", CASES)
def test_fp64_matches_the_reference(T, V, H, chunk):
    h, w, labels = inputs(T, V, H, torch.float64, seed=T)
    got = loss_and_grads(linear_cross_entropy, h, w, labels, chunk_tokens=chunk)
    want = loss_and_grads(linear_cross_entropy_reference, h, w, labels)
    assert got[0].dtype == torch.float64 and got[1].dtype == torch.int64 and int(got[1]) == int(want[1])
    assert abs(got[0].item() - want[0].item()) <= 1e-10 * abs(want[0].item())
    for a, b in zip(got[2:], want[2:]):
        assert a.dtype == torch.float64 and rel(a, b) < 1e-10


@pytest.mark.parametrize("T,V,H,chunk", CASES[:2])
def test_fp32_matches_the_reference(T, V, H, chunk):
    h, w, labels = inputs(T, V, H, torch.float32, seed=T)
    got = loss_and_grads(linear_cross_entropy, h, w, labels, chunk_tokens=chunk)
    want = loss_and_grads(linear_cross_entropy_reference, h.double(), w.double(), labels)
    assert got[0].dtype == torch.float32 and rel(got[0], want[0]) < 1e-5
    for a, b in zip(got[2:], want[2:]):
        assert a.dtype == torch.float32 and rel(a, b) < 1e-5


def test_bf16_within_bf16_tolerance_and_as_todays_unfused_path():
    T, V, H = 96, 200, 64
    h, w, labels = inputs(T, V, H, torch.bfloat16)
    got = loss_and_grads(linear_cross_entropy, h, w, labels, chunk_tokens=40)
    want = loss_and_grads(linear_cross_entropy_reference, h, w, labels)  # fp32 logits of the same bf16 inputs
    assert got[0].dtype == torch.float32 and rel(got[0], want[0]) < 5e-4  # bf16 logits: 2^-9 relative each
    for a, b in zip(got[2:], want[2:]):
        assert a.dtype == torch.bfloat16 and rel(a, b) < 1e-2
    # today's path: bf16 logits from F.linear, fp32 cross-entropy mean; the same logits, so much closer
    count = (labels != -100).sum()
    today = loss_and_grads(lambda a, b, y: (cross_entropy(F.linear(a, b), y), None), h, w, labels,
                           scale=0.37 * count.item())
    assert rel(got[0] / count, today[0]) < 1e-5
    for a, b in zip(got[2:], today[2:]):
        # today's rounds (scale * fp32 gradient) to bf16 for its GEMMs; ours the unscaled one, then the scaled dh, dW
        assert rel(a, b) < 5e-3


def test_all_ignored_gives_zero_and_zero_gradients():
    h, w, labels = inputs(10, 7, 4, torch.float64, ignored=1.0)
    loss, count, dh, dw = loss_and_grads(linear_cross_entropy, h, w, labels, chunk_tokens=3)
    assert loss.item() == 0.0 and int(count) == 0
    assert not dh.any() and not dw.any()
    assert linear_cross_entropy_mean(h, w, labels).item() == 0.0


def test_mean_is_todays_cross_entropy():
    h, w, labels = inputs(33, 19, 8, torch.float32)
    want = cross_entropy(F.linear(h, w), labels)  # today's contract: total / max(count, 1), in fp32
    got = linear_cross_entropy_mean(h, w, labels, chunk_tokens=4)
    assert got.dtype == torch.float32 and abs(got.item() - want.item()) < 1e-6 * want.item()


def test_tied_head_gradients_add_up():
    """The weight is also the embedding that makes h: its gradient is the loss's dW plus the embedding path's."""
    T, V, H = 21, 17, 8
    _, w, labels = inputs(T, V, H, torch.float64)
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))
    proj = torch.randn(H, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def model(fn, **kw):
        weight = w.clone().requires_grad_()
        h = torch.tanh(F.embedding(ids, weight) @ proj)
        loss, _ = fn(h, weight, labels, **kw)
        (loss + weight.square().sum()).backward()
        return loss.detach(), weight.grad

    got, want = model(linear_cross_entropy, chunk_tokens=4), model(linear_cross_entropy_reference)
    assert abs(got[0].item() - want[0].item()) < 1e-10 * abs(want[0].item())
    assert rel(got[1], want[1]) < 1e-10


def test_gradient_accumulation_over_two_calls():
    h1, w, y1 = inputs(20, 13, 6, torch.float64, seed=1)
    h2, _, y2 = inputs(15, 13, 6, torch.float64, seed=2)

    def two_micro_batches(fn, **kw):
        weight, leaves = w.clone().requires_grad_(), [h1.clone().requires_grad_(), h2.clone().requires_grad_()]
        for h, y, scale in zip(leaves, (y1, y2), (0.5, 0.25)):
            loss, _ = fn(h, weight, y, **kw)
            (loss * scale).backward()
        return [weight.grad] + [h.grad for h in leaves]

    for a, b in zip(two_micro_batches(linear_cross_entropy, chunk_tokens=7),
                    two_micro_batches(linear_cross_entropy_reference)):
        assert rel(a, b) < 1e-10


def saved_bytes(fn, *args, **kw) -> int:
    """Bytes of the storages autograd keeps for backward that are not the arguments' own."""
    own = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kw)
    return sum(kept.values())


def test_no_grad_and_a_frozen_head_skip_the_gradient_work():
    h, w, labels = inputs(30, 12, 5, torch.float64)
    want = linear_cross_entropy_reference(h, w, labels)[0]
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.no_grad():
        loss, count = linear_cross_entropy(hg, wg, labels, chunk_tokens=4)
    assert loss.grad_fn is None and abs(loss.item() - want.item()) < 1e-10 * want.item()
    assert saved_bytes(linear_cross_entropy, h, w, labels) == 0  # nothing requires grad
    # a frozen head keeps dh only, and gives the reference's dh
    assert saved_bytes(linear_cross_entropy, hg, w, labels) == h.numel() * 8
    loss, _ = linear_cross_entropy(hg, w, labels, chunk_tokens=4)
    loss.backward()
    ref_h = h.clone().requires_grad_()
    linear_cross_entropy_reference(ref_h, w, labels)[0].backward()
    assert rel(hg.grad, ref_h.grad) < 1e-10


def test_labels_outside_the_vocabulary():
    h, w, labels = inputs(12, 9, 4, torch.float32, ignored=0.0)
    for bad in (9, -1, 1000):
        wrong = labels.clone()
        wrong[5] = bad
        with pytest.raises(ValueError, match=rf"label {bad} of token 5 .* the vocabulary is \[0, 9\)"):
            linear_cross_entropy(h, w, wrong)
        # unchecked (as on a GPU by default): never out of bounds, and the loss is NaN without a host sync
        loss, count = linear_cross_entropy(h, w.clone().requires_grad_(), wrong, check_labels=False)
        assert torch.isnan(loss) and int(count) == 12
    assert linear_cross_entropy(h, w, torch.full((12,), -7), ignore_index=-7)[1].item() == 0


def test_no_host_sync_unless_labels_are_checked():
    """Forward and backward read no scalar on the host (the chunks are a function of the shapes); checking the labels
    costs one read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"):
                self.reads.append(func.__name__)
            return func(*args, **(kwargs or {}))

    h, w, labels = inputs(19, 11, 6, torch.float32)
    for check, reads in ((False, 0), (True, 1)):
        mode = HostReads()
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        with mode:
            loss, count = linear_cross_entropy(hg, wg, labels, chunk_tokens=4, check_labels=check)
            (loss / count).backward()
        assert len(mode.reads) == reads, mode.reads


def test_argument_errors_are_clear():
    h, w, labels = inputs(4, 5, 3, torch.float32)
    with pytest.raises(ValueError, match=r"must be \[T, H\], \[V, H\], \[T\]"):
        linear_cross_entropy(h, w.t(), labels)
    with pytest.raises(ValueError, match="must share one of"):
        linear_cross_entropy(h, w.double(), labels)
    with pytest.raises(ValueError, match="labels must be int64"):
        linear_cross_entropy(h, w, labels.int())
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        linear_cross_entropy(h, w, labels, chunk_tokens=0)


def test_default_chunk_keeps_a_chunks_logits_under_256_mib():
    assert default_chunk_tokens(129280) == 512  # DeepSeek-V3: 512 x 129280 x 4 B = 252 MiB
    assert default_chunk_tokens(151936) == 384  # Qwen3: a multiple of 128
    assert default_chunk_tokens(129280 // 8) == 4096  # a vocab-parallel rank of 8
    assert default_chunk_tokens(129280, torch.float64) == 256
    assert default_chunk_tokens(2**23) == 8 and default_chunk_tokens(2**30) == 1
    for V in (1000, 32768, 129280, 151936, 2**23):
        assert default_chunk_tokens(V) * V * 4 <= 256 * 2**20


def test_kernel_chunk_keeps_the_chunks_transient():
    """The Triton path keeps no fp32 copy of the logits: its chunk's [C, V] buffers are the b-byte logits with the
    gradient written over them (bCV), the PyTorch path's the fp32 copy plus the b-byte logits then gradient (6CV for
    bf16, 4CV for fp32). So the kernels take 3x the tokens for bf16 / fp16 in the same bytes (runtime.loss_chunk),
    the same tokens for fp32, and fp64 never runs them."""
    assert default_chunk_tokens(151936, torch.bfloat16, kernels=True) == 1152  # Qwen3: 3 x 384
    assert default_chunk_tokens(129280, torch.float16, kernels=True) == 1536  # DeepSeek-V3: 3 x 512
    for V in (1000, 32768, 129280, 151936, 2**23, 2**30):
        for dtype, b in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
            torch_c, kernel_c = default_chunk_tokens(V, dtype), default_chunk_tokens(V, dtype, kernels=True)
            assert kernel_c == (3 if b == 2 else 1) * torch_c
            assert b * kernel_c * V <= (6 if b == 2 else 4) * torch_c * V  # never more than today's transient
        assert default_chunk_tokens(V, torch.float64, kernels=True) == default_chunk_tokens(V, torch.float64)


class PeakBytes:
    """The peak, over the aten ops run inside, of the bytes of live storages those ops created (views of their
    arguments and in-place results are not new), sampled after each op: a CPU stand-in for the allocator's peak."""

    def __enter__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self
        self.live, self.peak = {}, 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                old = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor)}
                tracker.live = {k: v for k, v in tracker.live.items() if not v[0].expired()}
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in old:
                        st = t.untyped_storage()
                        tracker.live.setdefault(st.data_ptr(), (StorageWeakRef(st), st.nbytes()))
                tracker.peak = max(tracker.peak, sum(n for _, n in tracker.live.values()))
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_against_the_unfused_path(dtype):
    """``memory_against_the_unfused_path`` in a fresh process: after a torch.compile of other ops in the same process
    (tests/unit/test_compile.py), the eager bf16 peak holds one more bf16 [C, V] chunk (cause not found; the ops and
    their outputs are the same)."""
    code = f"import torch, test_linear_cross_entropy as t; t.memory_against_the_unfused_path(torch.{dtype})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def memory_against_the_unfused_path(dtype):
    """T = 2048, V = 32768, H = 128 (b bytes per element, C = 256 tokens per chunk; H small because the CPU's bf16
    [T, V] @ [V, H] GEMM of the unfused backward is slow). Kept for backward: the unfused path keeps the fp32
    log-probs [T, V] (4TV, the logits' own buffers are freed), the fused op dh [T, H] and dW [V, H] in the inputs'
    dtype, b(TH + VH): 256 MiB against 17 MiB (fp32, 15x) or 8.5 MiB (bf16, 30x). Forward peak: unfused 8TV (fp32:
    logits, log-probs) or 10TV (bf16: logits, their fp32 copy, log-probs), fused the fp32 dW accumulator 4VH, dh bTH
    and one chunk's 4CV acc logits (+ 2CV bf16, its GEMM output, then g): 512 MiB against 49 MiB (fp32), 640 MiB
    against 64.5 MiB (bf16)."""
    T, V, H, C = 2048, 32768, 128, 256
    b = dtype.itemsize
    h = torch.randn(T, H).to(dtype).requires_grad_()
    w = (torch.randn(V, H) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,))

    def unfused(a, c, y):
        return cross_entropy(F.linear(a, c), y)

    with PeakBytes() as peak_unfused:
        kept_unfused = saved_bytes(unfused, h, w, labels)
    with PeakBytes() as peak_fused:
        kept_fused = saved_bytes(linear_cross_entropy, h, w, labels, chunk_tokens=C)
    assert 0 <= kept_unfused - 4 * T * V < 64  # and two scalars: nll_loss's total weight, the mean's count
    assert kept_fused == b * (T * H + V * H)
    assert kept_unfused / kept_fused > (14 if b == 4 else 28)
    assert peak_unfused.peak == pytest.approx((8 if b == 4 else 10) * T * V, abs=2**16)
    want = 4 * V * H + b * T * H + 4 * C * V + (0 if b == 4 else 2 * C * V)
    # and the chunk's [C] vectors; for bf16 on the CPU the fp32 copy of the chunk's h [C, H] for dW's GEMM
    assert peak_fused.peak == pytest.approx(want, abs=2**19)
    assert peak_unfused.peak / peak_fused.peak > 9.5

def test_compiles_fullgraph_as_one_custom_op():
    from test_compile import graph_recorder, moetrain_ops_in

    h, w, labels = inputs(23, 17, 8, torch.float32)

    def step(fn, a, b):
        a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
        loss = fn(a, b, labels)
        loss.backward()
        return loss.detach(), a.grad, b.grad

    def mean(a, b, y):
        return linear_cross_entropy_mean(a, b, y, chunk_tokens=5)

    torch._dynamo.reset()
    graphs = []
    try:
        got = step(torch.compile(mean, fullgraph=True, backend=graph_recorder(graphs)), h, w)
    finally:
        torch._dynamo.reset()
    want = step(mean, h, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert len(graphs) == 1 and moetrain_ops_in(graphs) == {"moetrain.linear_cross_entropy.default"}
