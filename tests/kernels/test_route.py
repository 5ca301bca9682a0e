"""The fused routing kernel (impl "triton") against the PyTorch reference (impl "torch") of
moetrain.ops.route: indices, weights, counts and the gradient of the weights w.r.t. the logits.

Without a GPU the kernel runs in Triton's CPU interpreter (fp32). Scores are distinct (random
fp32 logits), so the top-k order is unambiguous.
Legend: T tokens, E experts, K top-k.
"""

import pytest
import torch

from triton_env import use_gpu_or_interpreter  # noqa: E402  (before any triton import)

ON_GPU = use_gpu_or_interpreter()

from moetrain.kernels import route as kernels  # noqa: E402
from moetrain.ops.route import route  # noqa: E402

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
    # several programs of several tokens each, the last one partial (tokens per program: 4096 / E)
    "blocks_qwen3_like": (77, 128, 8, {}),
    "blocks_dsv3_like": (40, 256, 8, dict(score="sigmoid", num_groups=8, topk_groups=4, group_score="top2_sum",
                                          bias=True, scaling_factor=2.5)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_route_matches_torch(name):
    T, E, K, kw = CASES[name]
    kw = dict(kw)
    g = torch.Generator().manual_seed(T * E + K)
    logits = torch.randn(T, E, generator=g) * 2
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE) if kw.pop("bias", False) else None
    probe = torch.randn(T, K, generator=g).to(DEVICE)
    got, want = {}, {}
    for impl, out in (("triton", got), ("torch", want)):
        leaf = logits.to(DEVICE).requires_grad_()
        r = route(leaf, K, expert_bias=bias, impl="triton", **kw) if impl == "triton" else \
            kernels.route_ref(leaf, K, expert_bias=bias, **kw)
        (r.topk_weight * probe).sum().backward()
        out.update(idx=r.topk_idx, weight=r.topk_weight.detach(), counts=r.counts, grad=leaf.grad)
    assert torch.equal(got["idx"], want["idx"])
    torch.testing.assert_close(got["weight"], want["weight"], rtol=1e-5, atol=1e-6)
    assert torch.equal(got["counts"], want["counts"]) and got["counts"].sum() == T * K
    torch.testing.assert_close(got["grad"], want["grad"], rtol=1e-5, atol=1e-6)


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
