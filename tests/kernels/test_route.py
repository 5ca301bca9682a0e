"""The fused routing kernel (impl "triton") against the PyTorch reference (impl "torch") of
moetrain.ops.route: indices, weights, counts and the gradient of the weights w.r.t. the logits;
and its backward kernel (kernels.route.route_backward) against topk_weights_backward directly.

Without a GPU the kernel runs in Triton's CPU interpreter (fp32). Scores are distinct (random
fp32 logits), so the top-k order is unambiguous.
Legend: T tokens, E experts, K top-k.
"""

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels import route as kernels  # noqa: E402
from moetrain.ops.route import route, topk_weights_backward  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"

CASES = {
    # name: (T, E, K, kwargs)
    "softmax": (37, 16, 4, {}),
    "softmax_k1_unnormalized": (9, 8, 1, dict(normalize=False)),
    "sigmoid_bias_groups_top2": (21, 32, 8, dict(score="sigmoid", num_groups=8, topk_groups=4, group_score="top2_sum",
                                                 bias=True, scaling_factor=2.5)),
    "groups_max_not_pow2": (13, 20, 3, dict(num_groups=4, topk_groups=2, group_score="max")),
    "e_not_pow2_k8": (11, 60, 8, dict(bias=True)),
    "single_expert": (5, 1, 1, {}),
    # several programs of several tokens each, the last one partial (tokens per program: kernels.route._program)
    "blocks_qwen3_like": (77, 128, 8, {}),
    "blocks_mixtral_like": (37, 8, 2, {}),  # the measured programs at 8 and 32 experts: 16 tokens each
    "blocks_gpt_oss_like": (37, 32, 4, {}),
    # (T kept small: the measured programs at 256 experts take 1 token each, and the interpreter's time goes by programs)
    "blocks_dsv3_like": (20, 256, 8, dict(score="sigmoid", num_groups=8, topk_groups=4, group_score="top2_sum",
                                          bias=True, scaling_factor=2.5)),
    "blocks_256_experts_no_groups": (21, 256, 8, {}),  # a measured program: 1 token on 1 warp
    # DeepSeek-V2's routing: 160 experts in 8 groups of 20, padded to [8, 32] (256 slots, a measured program)
    "dsv2_like_groups_padded": (19, 160, 6, dict(num_groups=8, topk_groups=3, group_score="max", normalize=False)),
}


@pytest.mark.parametrize("prob_sums", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_route_matches_torch(name, prob_sums, monkeypatch):
    backward_kernel, launches = kernels.route_backward, []
    monkeypatch.setattr(kernels, "route_backward", lambda *a, **k: launches.append(1) or backward_kernel(*a, **k))
    T, E, K, kw = CASES[name]
    kw = dict(kw)
    g = torch.Generator().manual_seed(T * E + K)
    logits = torch.randn(T, E, generator=g) * 2
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE) if kw.pop("bias", False) else None
    probe = torch.randn(T, K, generator=g).to(DEVICE)
    probe_e = torch.randn(E, generator=g).to(DEVICE)
    got, want = {}, {}
    for impl, out in (("triton", got), ("torch", want)):
        leaf = logits.to(DEVICE).requires_grad_()
        r = route(leaf, K, expert_bias=bias, impl="triton", prob_sums=prob_sums, **kw) if impl == "triton" else \
            kernels.route_ref(leaf, K, expert_bias=bias, prob_sums=prob_sums, **kw)
        loss = (r.topk_weight * probe).sum()
        if prob_sums:  # the aux loss's statistic and its gradient, through the same backward kernel
            loss = loss + (r.prob_sums * probe_e).sum()
            out.update(psum=r.prob_sums.detach())
        loss.backward()
        out.update(idx=r.topk_idx, weight=r.topk_weight.detach(), counts=r.counts, grad=leaf.grad)
    assert torch.equal(got["idx"], want["idx"])
    torch.testing.assert_close(got["weight"], want["weight"], rtol=1e-5, atol=1e-6)
    assert torch.equal(got["counts"], want["counts"]) and got["counts"].sum() == T * K
    if prob_sums:
        torch.testing.assert_close(got["psum"], want["psum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["grad"], want["grad"], rtol=1e-5, atol=1e-6)
    assert launches == [1]  # the triton route's gradient came from the backward kernel


BWD_CASES = {
    # name: (T, E, K, score, normalize, scaling_factor); tokens per program kernels.route._program's
    "softmax_blocks_partial_last": (77, 128, 8, "softmax", True, 1.0),
    "softmax_mixtral_like": (37, 8, 2, "softmax", True, 1.0),  # 16 tokens per program, the last partial
    "softmax_gpt_oss_like": (37, 32, 4, "softmax", True, 1.0),
    "sigmoid_e_not_pow2_k8": (45, 60, 8, "sigmoid", True, 2.5),
    "softmax_k1_unnormalized": (13, 20, 1, "softmax", False, 1.0),
    "sigmoid_k1_unnormalized": (9, 24, 1, "sigmoid", False, 0.5),
    "softmax_k1_normalized": (7, 12, 1, "softmax", True, 1.0),  # w = c: a gradient of ~0
    "sigmoid_unnormalized_k8": (30, 257, 8, "sigmoid", False, 1.0),
    "one_token_per_program": (3, 4100, 2, "softmax", True, 1.0),  # BLOCK_E 8192 > the tile
    "sigmoid_256_experts": (41, 256, 8, "sigmoid", True, 2.5),  # the measured program at 256 experts: 1 token, 1 warp
}


def bwd_inputs(T, E, K, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    idx = torch.randn(T, E, generator=g).argsort(-1)[:, :K]  # K distinct experts per token, any order
    dweight = torch.randn(T, K, generator=g)
    return logits, idx, dweight


def check_route_backward(logits, idx, dweight, score, normalize, scaling, **tol):
    want = topk_weights_backward(logits, idx, dweight, score, normalize, scaling)
    got = kernels.route_backward(logits.to(DEVICE), idx.to(DEVICE), dweight.to(DEVICE), score, normalize, scaling)
    assert got.dtype == logits.dtype and got.shape == logits.shape
    torch.testing.assert_close(got.cpu(), want, **(tol or dict(rtol=1e-5, atol=1e-6)))


@pytest.mark.parametrize("name", list(BWD_CASES))
def test_route_backward_matches_reference(name, poisoned_empty):
    T, E, K, score, normalize, scaling = BWD_CASES[name]
    logits, idx, dweight = bwd_inputs(T, E, K, seed=T + E + K)
    check_route_backward(logits, idx, dweight, score, normalize, scaling)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_backward_bf16_logits_give_bf16(score, poisoned_empty):
    # both sides compute in fp32 from the same bf16 logits and round once: at most an ulp of bf16 apart
    logits, idx, dweight = bwd_inputs(50, 60, 8, seed=11, dtype=torch.bfloat16)
    check_route_backward(logits, idx, dweight, score, True, 2.5, rtol=1.6e-2, atol=1e-4)


def test_route_backward_reads_strides_and_other_dweight_dtypes(poisoned_empty):
    # logits as a transposed view; dweight expanded from one value (what .sum()'s backward hands over; not
    # normalized, where the same g for every pick would cancel out), or bf16
    T, E, K = 33, 40, 4
    logits, idx, dweight = bwd_inputs(T, E, K, seed=5)
    check_route_backward(logits.t().contiguous().t(), idx, dweight, "softmax", True, 1.0)
    check_route_backward(logits, idx, torch.tensor(0.7).expand(T, K), "softmax", False, 1.0)
    check_route_backward(logits, idx, dweight.bfloat16(), "sigmoid", True, 1.0)


def test_route_backward_repeated_ids_add_up_like_the_reference(poisoned_empty):
    T, E, K = 10, 16, 4
    logits, _, dweight = bwd_inputs(T, E, K, seed=7)
    idx = torch.randint(0, 3, (T, K), generator=torch.Generator().manual_seed(8))  # repeats within rows
    for score in ("softmax", "sigmoid"):
        check_route_backward(logits, idx, dweight, score, True, 1.3)


def test_route_backward_of_no_tokens_is_empty():
    logits, idx, dweight = bwd_inputs(0, 16, 4, seed=1, dtype=torch.bfloat16)
    check_route_backward(logits, idx, dweight, "softmax", True, 1.0)


# (2, 1) and (2, 2): the programs that picked experts past E on the H200 with a [tokens, groups, group size] tile
# (bench/row_kernels.md)
@pytest.mark.parametrize("tokens,warps", [(2, 1), (2, 2), (4, 1), (8, 2), (16, 2), (64, 8)])
def test_every_program_shape_routes_alike(tokens, warps, poisoned_empty):
    # the row-kernel sweep's candidates (`moetrain bench rows`) must change the speed only
    T, E, K, kw = CASES["blocks_dsv3_like"]
    kw = dict(kw)
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(T, E, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE) if kw.pop("bias") else None
    args = (logits, K, kw["score"], kw["num_groups"], kw["topk_groups"], kw["group_score"], bias,
            kw["scaling_factor"], True, True)
    got = kernels.route(*args, tokens_per_program=tokens, warps=warps)
    want = kernels.route(*args)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    dweight = torch.randn(T, K, generator=g).to(DEVICE)
    bwd = (logits, got[0], dweight, "sigmoid", True, 2.5)
    assert torch.allclose(kernels.route_backward(*bwd, tokens_per_program=tokens, warps=warps),
                          kernels.route_backward(*bwd), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="power of two"):
        kernels.route(*args, tokens_per_program=3)
    with pytest.raises(ValueError, match="power of two"):
        kernels.route(*args, warps=3)


def test_group_limited_selection_stays_in_the_best_groups():
    T, E, G = 6, 16, 4
    logits = torch.full((T, E), -5.0)
    logits[:, 4:8] = torch.arange(4.0)  # group 1 holds the best experts
    logits[:, 12] = 10.0  # group 3 holds the single best expert
    r = route(logits.to(DEVICE), 3, num_groups=G, topk_groups=2, group_score="max", impl="triton")
    assert r.topk_idx[0].tolist() == [12, 7, 6]
    r = route(logits.to(DEVICE), 3, num_groups=G, topk_groups=1, group_score="max", impl="triton")
    assert r.topk_idx[0].tolist() == [12, 13, 14]  # only group 3 is selectable; ties go to the lower id


@pytest.mark.parametrize("bad, match", [
    (dict(topk=9), "topk"), (dict(num_groups=3, topk_groups=1), "num_groups"),
    (dict(num_groups=4, topk_groups=1, topk=3), "exceeds"), (dict(score="relu"), "score"),
    (dict(impl="cuda"), "implementation")])
def test_bad_arguments_are_errors(bad, match):
    args = dict(topk=2)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        route(torch.randn(4, 8, device=DEVICE), args.pop("topk"), **args)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_prob_sums_alone_get_their_gradient(score):
    # no gradient reaches the weights (the backward kernel's HAS_DWEIGHT off): only the aux loss's statistic's
    T, E, K = 37, 20, 3
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=g) * 2
    probe_e = torch.randn(E, generator=g)
    grads = []
    for impl in ("triton", "torch"):
        leaf = logits.to(DEVICE).requires_grad_()
        r = route(leaf, K, score=score, impl=impl, prob_sums=True)
        (r.prob_sums * probe_e.to(DEVICE)).sum().backward()
        grads.append(leaf.grad.cpu())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_batch_aux_loss_from_the_kernel_matches_pytorch(score):
    # the model's router: the batch aux loss from the routing kernel's counts and prob sums against the PyTorch
    # loss (load_balancing_loss over recomputed scores), value and gradient of the router weight
    from moetrain.config.schema import Config
    from moetrain.models.moe.router import Router, load_balancing_loss, scores_of

    cfg = Config()
    cfg.model.hidden_size, cfg.moe.num_experts, cfg.moe.topk = 24, 12, 3
    cfg.moe.score_function, cfg.moe.aux_loss_coeff, cfg.moe.aux_loss_type = score, 1.0, "batch"
    cfg.moe.backend = "triton"
    router = Router(cfg)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        router.weight.copy_(torch.randn(12, 24, generator=g))
    router.to(DEVICE)
    x = torch.randn(41, 24, generator=g).to(DEVICE)
    out = router(x)
    (dw,) = torch.autograd.grad(out.aux_loss, router.weight)
    logits = x @ router.weight.t()
    probs = scores_of(logits, score)
    probs = probs if score == "softmax" else probs / probs.sum(-1, keepdim=True)
    want = load_balancing_loss(probs, out.topk_idx, 12)
    (want_dw,) = torch.autograd.grad(want, router.weight)
    torch.testing.assert_close(out.aux_loss, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dw, want_dw, rtol=1e-4, atol=1e-7)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moetrain.kernels import route as k
from moetrain.kernels.grouped_gemm_aot import spill_bytes
fwd = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "idx_ptr": "*i64", "weight_ptr": "*fp32", "counts_ptr": "*fp32",
       "psum_ptr": "*fp32", "T": "i32", "E": "i32", "scaling": "fp32"}
bwd = {"logits_ptr": "*fp32", "idx_ptr": "*i64", "dweight_ptr": "*fp32", "dpsum_ptr": "*fp32", "dlogits_ptr": "*fp32",
       "T": "i32", "E": "i32", "scaling": "fp32",
       **{n: "i32" for n in ("stride_lt", "stride_le", "stride_it", "stride_ik", "stride_dt", "stride_dk")}}
# Qwen3's softmax, and with 8 groups; DeepSeek-V3's sigmoid with groups and without; Mixtral's and GPT-OSS's softmax:
# the programs the launchers pick (k._program)
for E, G, sig, K in ((128, 1, False, 8), (128, 8, True, 8), (256, 8, True, 8), (256, 1, True, 8), (8, 1, False, 2),
                     (32, 1, False, 4)):
    tokens, warps = k._program(E, 16384, None, None, backward=False, grouped=G > 1)
    c = dict(TOPK=K, BLOCK_K=K, GROUPS=G, GROUP_SIZE=E // G, BLOCK_T=tokens, BLOCK_G=G, BLOCK_GS=E // G,
             TOPK_GROUPS=max(1, G // 2), SIGMOID=sig, HAS_BIAS=sig, TOP2_SUM=sig, NORMALIZE=True, HAS_PSUM=True)
    ck = triton.compile(ASTSource(fn=k._route_kernel, signature={**fwd, **dict.fromkeys(c, "constexpr")},
                                  constexprs=c), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert spill_bytes(ck.asm["ptx"]) in (0, None), (E, G)
    tokens, warps = k._program(E, 16384, None, None, backward=True)
    for has_dw in (True, False):
        c = dict(TOPK=K, BLOCK_T=tokens, BLOCK_E=E, SIGMOID=sig, NORMALIZE=True, HAS_DWEIGHT=has_dw, HAS_DPSUM=True)
        ck = triton.compile(ASTSource(fn=k._route_bwd_kernel, signature={**bwd, **dict.fromkeys(c, "constexpr")},
                                      constexprs=c), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert spill_bytes(ck.asm["ptx"]) in (0, None), (E, has_dw)
print("ok")
"""


def test_route_kernels_with_the_aux_statistics_compile_for_sm90():
    if ON_GPU:
        pytest.skip("the CUDA tests run the kernels themselves")
    from kernel_checks import script_result

    assert script_result(_COMPILE) == "ok"
