"""kernels/launch.py on the GPU (marked gpu): direct launches compute what Triton's own launches do, on aligned and
misaligned tensors and every integer class, and every kernel kept is the one Triton's binder picks for the same
arguments (so a key never lumps together calls Triton compiles apart)."""

import pytest
import torch

pytestmark = pytest.mark.gpu
triton = pytest.importorskip("triton", reason="the triton package is not installed")
tl = pytest.importorskip("triton.language")

from moetrain.kernels import launch as L  # noqa: E402


@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=ok) * scale + tl.load(y_ptr + i, mask=ok), mask=ok)


def needs_compiled_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moetrain.kernels.grouped_gemm_configs import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process")
    if not L._direct_launches():
        pytest.skip(f"triton {triton.__version__}: direct launches are off")


@pytest.mark.parametrize("offset", [0, 1, 4])
@pytest.mark.parametrize("n", [1, 16, 17, 1000, 4096])
@pytest.mark.parametrize("block", [64, 256])
def test_direct_launches_match_triton_and_keep_its_kernel(offset, n, block):
    needs_compiled_kernels()
    base = torch.randn(3, n + 8, device="cuda")
    x, y = base[0, offset:offset + n], base[1, offset:offset + n]
    grid = (triton.cdiv(n, block),)
    for _ in range(3):  # the first call goes through Triton and keeps its kernel; the others launch it directly
        out = torch.full((n + 8,), float("nan"), device="cuda")[offset:offset + n]
        L.launch(_scaled_add_kernel, grid, x, y, out, n, 0.5, BLOCK=block, num_warps=4)
        torch.testing.assert_close(out, x * 0.5 + y, rtol=0, atol=0)
    key = L.kernel_key(_scaled_add_kernel, torch.cuda.current_device(), (x, y, out, n, 0.5),
                       {"BLOCK": block, "num_warps": 4})
    assert L.cached_kernels()[key] is _scaled_add_kernel.warmup(x, y, out, n, 0.5, grid=grid, BLOCK=block,
                                                                num_warps=4)


def test_a_cpu_tensor_after_cuda_ones_is_refused_not_launched():
    # the key tells a CPU tensor from a CUDA one, so Triton's own launcher sees it and refuses it
    needs_compiled_kernels()
    x = torch.zeros(16, device="cuda")
    for _ in range(2):
        L.launch(_scaled_add_kernel, (1,), x, x, x, 16, 1.0, BLOCK=16)
    with pytest.raises(ValueError, match="cpu tensor"):
        L.launch(_scaled_add_kernel, (1,), x, torch.zeros(16), x, 16, 1.0, BLOCK=16)
    torch.cuda.synchronize()


def test_a_parameter_left_to_its_default_is_refused():
    needs_compiled_kernels()
    x = torch.zeros(16, device="cuda")
    with pytest.raises(ValueError, match="parameters \\['BLOCK'\\] must be passed"):
        L.launch(_scaled_add_kernel, (1,), x, x, x, 16, 1.0)


def test_runtime_arguments_by_keyword_are_refused():
    needs_compiled_kernels()
    x = torch.zeros(16, device="cuda")
    with pytest.raises(ValueError, match="runtime arguments \\['n', 'scale'\\] must be positional"):
        L.launch(_scaled_add_kernel, (1,), x, x, x, scale=1.0, n=16, BLOCK=16)


def test_the_layer_runs_the_same_launched_directly():
    # the fused layer forward + backward twice: launched through Triton the first time, directly the second; the same
    # bits both times
    needs_compiled_kernels()
    from moetrain import ops

    torch.manual_seed(0)
    T, H, I, E, K = 512, 256, 128, 8, 2
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda") / I**0.5).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, device="cuda", requires_grad=True)
    outs = []
    for _ in range(2):
        r = ops.route(logits, K, impl="triton")
        y = ops.moe_experts(x, r.topk_idx, r.topk_weight, w1, w2, backend="triton")
        grads = torch.autograd.grad(y.float().square().sum(), (x, w1, w2, logits))
        outs.append((y, *grads))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    kept = {key[0].__name__ for key in L.cached_kernels()}
    assert {"_route_kernel", "_chunk_counts_kernel", "_place_rows_kernel", "_swiglu_bwd_kernel"} <= kept, kept
