"""Router against hand-computed references (scores, top-k, groups, expert bias, capacity, losses)."""

import math

import pytest
import torch

from moetrain.config.schema import Config
from moetrain.models.moe.router import Router, drop_over_capacity, group_limited_mask


def make_router(E=8, K=2, **moe):
    """A router whose logits equal its input: hidden_size = E, weight = identity."""
    cfg = Config()
    cfg.model.hidden_size = E
    cfg.moe.num_experts, cfg.moe.topk = E, K
    for key, value in moe.items():
        setattr(cfg.moe, key, value)
    r = Router(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))
        if r.bias is not None:
            r.bias.zero_()
    return r


LOGITS = [
    [2.0, 1.0, 0.5, 0.0, -1.0, 0.3, 0.2, 0.1],
    [0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 2.5],
    [1.0, 1.5, 0.0, 0.1, 0.2, 0.3, -0.5, -2.0],
    [0.0, 0.0, 0.0, 0.0, 4.0, 3.9, 0.0, 0.0],
]


def softmax_row(row):
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def test_softmax_topk_weights_counts_aux_z():
    r = make_router(aux_loss_coeff=1.0, z_loss_coeff=1.0)
    out = r(torch.tensor(LOGITS))
    assert out.topk_idx.tolist() == [[0, 1], [2, 7], [1, 0], [4, 5]]
    for t, (a, b) in enumerate(out.topk_idx.tolist()):
        la, lb = LOGITS[t][a], LOGITS[t][b]
        wa = math.exp(la) / (math.exp(la) + math.exp(lb))
        assert out.topk_weight[t].tolist() == pytest.approx([wa, 1 - wa], abs=1e-6)
    assert out.counts.tolist() == [2, 2, 1, 0, 1, 1, 0, 1]
    # aux = E * sum_e f_e P_e, f_e = count_e / (T*K), P_e = mean softmax prob
    probs = [softmax_row(row) for row in LOGITS]
    counts = [2, 2, 1, 0, 1, 1, 0, 1]
    aux = 8 * sum(counts[e] / 8 * sum(p[e] for p in probs) / 4 for e in range(8))
    assert out.aux_loss.item() == pytest.approx(aux, rel=1e-6)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS) / 4
    assert out.z_loss.item() == pytest.approx(z, rel=1e-6)


def test_softmax_without_renormalisation_and_scaling():
    r = make_router(normalize_topk=False, scaling_factor=3.0)
    out = r(torch.tensor(LOGITS))
    for t, (a, b) in enumerate(out.topk_idx.tolist()):
        p = softmax_row(LOGITS[t])
        assert out.topk_weight[t].tolist() == pytest.approx([3 * p[a], 3 * p[b]], abs=1e-6)


def test_sequence_aux_loss_averages_over_sequences():
    r = make_router(aux_loss_coeff=1.0, aux_loss_type="sequence")
    out = r(torch.tensor(LOGITS), seq_len=2)
    idx = [[0, 1], [2, 7], [1, 0], [4, 5]]
    probs = [softmax_row(row) for row in LOGITS]
    per_seq = []
    for s in range(2):
        toks = [2 * s, 2 * s + 1]
        f = [sum(idx[t].count(e) for t in toks) / (2 * 2) for e in range(8)]
        P = [sum(probs[t][e] for t in toks) / 2 for e in range(8)]
        per_seq.append(8 * sum(fe * pe for fe, pe in zip(f, P)))
    assert out.aux_loss.item() == pytest.approx(sum(per_seq) / 2, rel=1e-6)


def sig(v):
    return 1 / (1 + math.exp(-v))


def test_sigmoid_group_limited_top2_sum():
    row = [3.0, -3.0, -2.0, -4.0, 2.5, 2.4, -3.0, -3.0]
    free = make_router(score_function="sigmoid")
    assert sorted(free(torch.tensor([row])).topk_idx[0].tolist()) == [0, 4]
    # group 0 = experts 0-3: top-2 sum sig(3)+sig(-2) = 1.07; group 1: sig(2.5)+sig(2.4) = 1.84
    r = make_router(score_function="sigmoid", num_groups=2, topk_groups=1, group_score="top2_sum",
                    scaling_factor=2.5)
    out = r(torch.tensor([row]))
    assert out.topk_idx[0].tolist() == [4, 5]
    s4, s5 = sig(2.5), sig(2.4)
    assert out.topk_weight[0].tolist() == pytest.approx([2.5 * s4 / (s4 + s5), 2.5 * s5 / (s4 + s5)], abs=1e-6)
    # group max ranks group 0 first (sig(3) > sig(2.5)), then the two best inside it: 0 and 2
    rmax = make_router(score_function="sigmoid", num_groups=2, topk_groups=1, group_score="max")
    assert rmax(torch.tensor([row])).topk_idx[0].tolist() == [0, 2]


def test_group_mask_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    sel = torch.rand(20, 12, generator=g)
    mask = group_limited_mask(sel, num_groups=4, topk_groups=2, group_score="top2_sum")
    for t in range(20):
        gs = [sum(sorted(sel[t, 3 * j:3 * j + 3].tolist())[-2:]) for j in range(4)]
        best = sorted(range(4), key=lambda j: -gs[j])[:2]
        want = [e // 3 in best for e in range(12)]
        assert mask[t].tolist() == want


def test_expert_bias_changes_selection_not_weights():
    row = [1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]
    r = make_router(score_function="sigmoid", expert_bias=True)
    assert r(torch.tensor([row])).topk_idx[0].tolist() == [0, 1]
    r.expert_bias[7] = 5.0
    out = r(torch.tensor([row]))
    assert out.topk_idx[0].tolist() == [7, 0]
    s7, s0 = sig(-1.0), sig(1.0)  # weights from the unbiased scores
    assert out.topk_weight[0].tolist() == pytest.approx([s7 / (s0 + s7), s0 / (s0 + s7)], abs=1e-6)


def test_capacity_drops_lowest_weight_first():
    # 4 tokens all prefer expert 0 of 2; capacity = ceil(1.0 * 4 * 1 / 2) = 2
    x = torch.tensor([[0.1, 0.0], [2.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
    r = make_router(E=2, K=1, capacity_factor=1.0, normalize_topk=False)
    out = r(x)
    assert out.topk_idx[:, 0].tolist() == [-1, 0, -1, 0]  # t3 and t1 have the largest weights
    p1, p3 = softmax_row([2.0, 0.0])[0], softmax_row([3.0, 0.0])[0]
    assert out.topk_weight[:, 0].tolist() == pytest.approx([0.0, p1, 0.0, p3], abs=1e-6)
    assert out.counts.tolist() == [4, 0]  # demand, before dropping
    # with renormalised top-1 every weight is 1: ties keep the earlier tokens
    out = make_router(E=2, K=1, capacity_factor=1.0)(x)
    assert out.topk_idx[:, 0].tolist() == [0, 0, -1, -1]


def test_drop_over_capacity_matches_loop_reference():
    g = torch.Generator().manual_seed(1)
    T, K, E, C = 30, 3, 5, 10
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).round(decimals=1)  # rounding makes ties
    got_idx, got_w = drop_over_capacity(idx, w, C, E)
    keep = set()
    for e in range(E):
        items = [(-w[t, k].item(), t * K + k) for t in range(T) for k in range(K) if idx[t, k] == e]
        keep |= {pos for _, pos in sorted(items)[:C]}
    for t in range(T):
        for k in range(K):
            kept = t * K + k in keep
            assert got_idx[t, k].item() == (idx[t, k].item() if kept else -1)
            assert got_w[t, k].item() == (w[t, k].item() if kept else 0.0)


def test_force_even_round_robin():
    r = make_router(E=4, K=2, force_balance="even")
    out = r(torch.randn(5, 4))
    assert out.topk_idx.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    assert out.topk_weight.tolist() == [[0.5, 0.5]] * 5
    assert out.counts.tolist() == [3, 3, 2, 2]


def test_force_uniform_random_logits():
    r = make_router(E=8, K=2, force_balance="uniform")
    x = torch.tensor(LOGITS * 50)  # every token would pick the same experts as LOGITS
    torch.manual_seed(3)
    a = r(x)
    torch.manual_seed(3)
    b = r(x)
    assert torch.equal(a.topk_idx, b.topk_idx)
    assert torch.allclose(a.topk_weight.sum(-1), torch.ones(200))
    assert (a.counts > 0).all()  # 200 tokens of random logits reach every expert
    torch.manual_seed(3)
    noise = torch.randn(200, 8)
    assert torch.equal(a.topk_idx, noise.topk(2, dim=-1).indices)


def test_router_bias_enters_logits():
    r = make_router(E=4, K=1, router_bias=True)
    with torch.no_grad():
        r.bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))
    out = r(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert out.topk_idx.tolist() == [[2]]
    assert out.logits.tolist() == [[1.0, 0.0, 10.0, 0.0]]


def test_router_grads_flow_to_weight():
    r = make_router(aux_loss_coeff=1.0, z_loss_coeff=1.0)
    out = r(torch.tensor(LOGITS))
    (out.topk_weight[:, 0].sum() + out.aux_loss + out.z_loss).backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_topk_weights_backward_is_the_chain_rule_of_topk_weights(score, normalize, dtype):
    # the routing kernel's backward: written out, equal to autograd through the PyTorch weights
    from moetrain.ops.route import scores_of, topk_weights, topk_weights_backward

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(19, 12, generator=g, dtype=torch.float64) * 2).to(dtype)
    idx = torch.randn(19, 12, generator=g).argsort(-1)[:, :4]
    dweight = torch.randn(19, 4, generator=g, dtype=torch.float64).float()
    leaf = logits.clone().requires_grad_()
    topk_weights(scores_of(leaf, score), idx, score, normalize, 1.7).backward(dweight.to(scores_of(leaf, score).dtype))
    got = topk_weights_backward(logits, idx, dweight, score, normalize, 1.7)
    assert got.dtype == dtype
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(got, leaf.grad, **tol)
