"""The Triton AdamW path on a GPU: ``grad_norm`` + ``step_on_device`` captured in one CUDA graph and replayed with new
gradients, learning rates and a skipped step gives the same bits as the same calls made eagerly (tables made
before the capture by ``prepare_device_step``; nothing copied in during it), for mixed-precision state with main
gradients and for bf16 state whose gradients are ``param.grad``. (tests/kernels/test_adamw.py and
test_adamw_optimizer.py run on the GPU too, against the references.)"""

import pytest
import torch
from torch import nn

from moetrain.config.schema import OptimConfig

pytestmark = pytest.mark.gpu


def _opt(master, grads, m, v):
    gen = torch.Generator().manual_seed(0)
    shapes = [(1000, 257), (7169,), (1,), (64, 64)]
    named = [(f"p{i}", nn.Parameter(torch.randn(s, generator=gen).to("cuda", torch.bfloat16)))
             for i, s in enumerate(shapes)]
    from moetrain.train.optim import PrecisionAwareAdamW

    cfg = OptimConfig(weight_decay=0.1, main_grads_dtype=grads, exp_avg_dtype=m, exp_avg_sq_dtype=v)
    return PrecisionAwareAdamW(named, cfg, master, kernel=True)


def _grads(opt, seed, in_place):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for s in opt.slots:
        g = torch.randn(s.param.shape, device="cuda", generator=gen) * 0.1
        if s.main_grad is not None:
            s.main_grad.copy_(g)
        elif in_place:  # a captured graph reads the buffers it saw
            s.param.grad.copy_(g)
        else:
            s.param.grad = g.to(s.param.dtype)


def _step(opt, lr, keep):
    opt.step_on_device(lr, opt.grad_norm(), keep, 1.0)


@pytest.mark.parametrize("state", [(True, "fp32", "bf16", "fp32"), (False, "bf16", "bf16", "bf16")])
def test_captured_norm_and_update_replay_like_eager_calls(state):
    eager, graphed = _opt(*state), _opt(*state)
    lr_e, lr_g = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    keep_e, keep_g = torch.ones((), device="cuda"), torch.ones((), device="cuda")
    _grads(eager, 0, False)
    _grads(graphed, 0, False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for opt, lr, keep in ((eager, lr_e, keep_e), (graphed, lr_g, keep_g)):  # warm-up: compiles
            lr.fill_(1e-3)
            _step(opt, lr, keep)
        graphed.prepare_device_step(torch.device("cuda"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            _step(graphed, lr_g, keep_g)
    torch.cuda.current_stream().wait_stream(stream)
    for i, (lr, keep) in enumerate([(1e-3, 1.0), (5e-4, 0.0), (2e-3, 1.0)]):  # the second step skipped
        _grads(eager, i + 1, True)
        _grads(graphed, i + 1, True)
        lr_e.fill_(lr), lr_g.fill_(lr), keep_e.fill_(keep), keep_g.fill_(keep)
        _step(eager, lr_e, keep_e)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager.slots, graphed.slots):
            for x, y in ((a.param, b.param), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)):
                assert torch.equal(x, y), (a.name, i)
    assert torch.equal(eager.device_step_counter(torch.device("cuda")), graphed.device_step_counter(
        torch.device("cuda")))
