"""The fused path's Triton sort (moetrain.kernels.sort_rows) against the PyTorch sort it replaces
(ops.moe.sort_rows + moe_rows.inverse_permutation): the same stable order, group ends, inverse and tokens.
Runs in the Triton interpreter on the CPU (TRITON_INTERPRET=1, set before triton is imported), on CUDA with one.
Outputs are compared exactly (integers)."""

import pytest
import torch

from kernel_checks import run_without_interpreter, script_result
from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels import sort_rows as kernel  # noqa: E402
from moetrain.ops import moe, moe_rows  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def routing(T, K, E, seed, *, skew=False, dropped=0.0, one_expert=False):
    g = torch.Generator().manual_seed(seed)
    if E >= K:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    else:
        idx = torch.randint(0, E, (T, K), generator=g)
    idx = idx.long()
    if skew:  # most rows to two experts, many experts empty
        idx[: T * 3 // 4, 0] = E - 1
        if K > 1:
            idx[: T // 2, -1] = 0
    if one_expert:
        idx[:] = 0
    if dropped:
        idx[torch.rand(T, K, generator=g) < dropped] = -1
    return idx


CASES = {  # name: (T, K, E, options)
    "uneven": (300, 4, 16, {"skew": True}),
    "dropped": (257, 2, 8, {"dropped": 0.2}),
    "one_expert_gets_all": (130, 8, 64, {"one_expert": True}),
    "single_expert": (77, 1, 1, {}),
    "k1": (1000, 1, 128, {}),
    "k8_qwen3_like": (1500, 8, 128, {}),
    "dsv3_like_256_experts": (700, 8, 256, {"skew": True, "dropped": 0.05}),
    # more chunks (38 of 64 assignments, the last partial) than a placing program sums at once (16): three turns
    # of its loop over the counts, the last partial
    "many_chunks": (300, 8, 32, {"dropped": 0.01, "chunk": 64}),
    "empty": (0, 4, 8, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_pytorch_sort(name, poisoned_empty):
    T, K, E, opts = CASES[name]
    opts = dict(opts)
    chunk = opts.pop("chunk", None)
    idx = routing(T, K, E, seed=T + E, **opts).to(DEVICE)
    offs, row_map, inverse, tokens = kernel.sort_rows(idx, E, chunk=chunk)
    want_offs, want_map = moe.sort_rows(idx, E)
    assert offs.dtype == torch.int32 and row_map.dtype == torch.int64 and inverse.dtype == torch.int64
    assert tokens.dtype == torch.int32
    assert torch.equal(offs.cpu(), want_offs.cpu())
    assert torch.equal(row_map.cpu(), want_map.cpu())  # the same stable order
    assert torch.equal(inverse.cpu(), moe_rows.inverse_permutation(want_map).cpu())
    assert torch.equal(tokens.cpu().long(), want_map.cpu() // K)


def test_the_default_chunk_keeps_the_programs_at_most_max_chunks():
    assert kernel.chunk_size(1) == kernel.MIN_CHUNK
    assert kernel.chunk_size(kernel.MIN_CHUNK * kernel.MAX_CHUNKS) == kernel.MIN_CHUNK
    assert kernel.chunk_size(16385 * 8) == 1024  # 131080 assignments: 129 chunks of 1024, not 257 of 512
    for assignments in (1, 511, 512, 131072, 131073, 10**6, 10**8):
        chunk = kernel.chunk_size(assignments)
        assert chunk >= kernel.MIN_CHUNK and chunk & (chunk - 1) == 0
        assert -(-assignments // chunk) <= kernel.MAX_CHUNKS


@pytest.mark.parametrize("knobs", [dict(chunk=256, sub=32, warps=4), dict(chunk=512, sub=64, warps=2),
                                   dict(chunk=128, sub=128, warps=8)])
def test_every_program_shape_gives_the_same_sort(knobs, poisoned_empty):
    # the row-kernel sweep's candidates (`moetrain bench rows`) must change the speed only
    T, K, E, opts = CASES["dsv3_like_256_experts"]
    idx = routing(T, K, E, seed=3, **opts).to(DEVICE)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for got, want in zip(kernel.sort_rows(idx, E, weights, **knobs), kernel.sort_rows(idx, E, weights)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="power of two"):
        kernel.sort_rows(idx, E, chunk=300)
    with pytest.raises(ValueError, match="sub=256"):
        kernel.sort_rows(idx, E, chunk=128, sub=256)


@pytest.mark.parametrize("name", ["dropped", "dsv3_like_256_experts", "single_expert", "empty"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_weights_in_row_order_and_their_gradient(name, wdtype, poisoned_empty):
    T, K, E, opts = CASES[name]
    g = torch.Generator().manual_seed(T * 7 + K)
    idx = routing(T, K, E, seed=T + E, **opts).to(DEVICE)
    weights = torch.rand(T, K, generator=g).to(DEVICE, wdtype)
    plain = kernel.sort_rows(idx, E)
    offs, row_map, inverse, tokens, probs = kernel.sort_rows(idx, E, weights=weights)
    for got, want in zip((offs, row_map, inverse, tokens), plain):
        assert torch.equal(got, want)
    live = weights.float().masked_fill(idx < 0, 0.0).reshape(-1)
    assert probs.dtype == torch.float32 and torch.equal(probs.cpu(), live.index_select(0, row_map).cpu())
    dprobs = torch.randn(T * K, generator=g).to(DEVICE)
    dweights = kernel.routing_weight_grad(dprobs, inverse, idx, wdtype)
    want = dprobs.index_select(0, inverse).view(T, K).masked_fill(idx < 0, 0.0)
    assert dweights.dtype == wdtype
    # one rounding to the weights' dtype (the interpreter's bf16 cast may round otherwise than torch's)
    torch.testing.assert_close(dweights.float().cpu(), want.cpu(), rtol=0 if wdtype == torch.float32 else 2**-7,
                               atol=0)
    assert torch.equal((dweights == 0).cpu(), (want == 0).cpu())  # dropped assignments: exactly none


def test_weights_of_another_shape_are_refused():
    idx = routing(4, 2, 8, seed=1).to(DEVICE)
    with pytest.raises(ValueError, match=r"weights \(4, 3\) must be \[T, K\]"):
        kernel.sort_rows(idx, 8, weights=torch.ones(4, 3, device=DEVICE))


@pytest.mark.gpu
def test_an_expert_id_past_the_last_is_a_device_side_error():
    # in a subprocess: a device-side assert leaves its CUDA context unusable
    if not ON_GPU:
        pytest.skip("the device assert is compiled for the GPU (the interpreter skips device asserts)")
    code = ("import torch; from moetrain.kernels.sort_rows import sort_rows; "
            "sort_rows(torch.tensor([[0, 1], [2, 4]], device='cuda'), 4); torch.cuda.synchronize()")
    proc = run_without_interpreter(code)
    assert proc.returncode != 0 and "expert id >= num_experts" in proc.stderr + proc.stdout


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetrain.kernels import sort_rows as k
common = {"idx_ptr": "*i64", "counts_ptr": "*i32", "M": "i32", "E": "i32"}
counts = ASTSource(fn=k._chunk_counts_kernel, signature={**common, "CHUNK": "constexpr", "BLOCK_E": "constexpr"},
                   constexprs={"CHUNK": 1024, "BLOCK_E": 256})
place = ASTSource(fn=k._place_rows_kernel, signature={
    **common, "offs_ptr": "*i32", "row_map_ptr": "*i64", "inverse_ptr": "*i64", "token_ptr": "*i32",
    "weight_ptr": "*fp32", "probs_ptr": "*fp32", "K": "i32", "n_chunks": "i32", "CHUNK": "constexpr",
    "SUB": "constexpr", "BLOCK_E": "constexpr", "BLOCK_C": "constexpr", "HAS_WEIGHTS": "constexpr"},
    constexprs={"CHUNK": 1024, "SUB": k.SUB, "BLOCK_E": 256, "BLOCK_C": 16, "HAS_WEIGHTS": True})
grad = ASTSource(fn=k._weight_grad_kernel, signature={"dprobs_ptr": "*fp32", "inverse_ptr": "*i64", "idx_ptr": "*i64",
    "out_ptr": "*bf16", "M": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 1024})
for src, warps in ((counts, 4), (place, 8), (grad, 4)):
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert ck.metadata.shared <= 232448, ck.metadata.shared
print("ok")
"""


def test_both_kernels_compile_for_sm90():
    # the GPU lowering of histogram, cumsum and gather at the largest sizes the launcher picks for <= 256 experts
    if ON_GPU:
        pytest.skip("the CUDA tests run the kernels themselves")
    assert script_result(_COMPILE) == "ok"
