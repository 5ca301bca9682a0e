"""``plan perf --measure``: time one decoder block of each kind, and the head (final norm, logits,
fp32 cross-entropy), forward + backward on the GPU.

Legend: B sequences, S sequence length (per CP rank), H hidden, E experts.

The block is built from the config exactly as the model builds it (DecoderLayer, same recompute
mode), fed random [B, S, H] activations in the parameter dtype, and timed with CUDA events
after warm-up; the medians replace the roofline's compute for that block kind. With expert
parallelism the block holds E / ep experts and keeps top-k (the rows per rank are the same as
without EP for balanced routing); tensor parallelism divides the measured time by tp
(an approximation: the collectives are modelled separately).
Imports torch (only this module of the planner does).
"""

from __future__ import annotations

import copy
import statistics

from moetrain.config.schema import Config
from moetrain.errors import UserError


def _local_config(cfg: Config) -> Config:
    c = copy.deepcopy(cfg)
    e, p = c.moe, c.parallel
    if e.num_experts and p.ep > 1:
        e.num_experts = max(e.num_experts // p.ep, e.topk)
        e.num_groups = e.topk_groups = None
    c.train.seq_length = cfg.train.seq_length // p.cp
    return c


def measure_blocks(cfg: Config, warmup: int = 3, iters: int = 8, device: str = "cuda") -> dict[str, tuple[float, float]]:
    """{"dense"|"moe"|"head": (forward seconds, backward seconds)} for the block kinds of ``cfg`` and its
    head + loss (vocab / tp columns are timed whole; the projection divides by tp as for blocks). The
    backward includes the trainer's main-gradient hooks (moetrain.train.optim) where the config has them;
    with train.cuda_graph the forward and the backward are timed as CUDA-graph replays.
    ``device="cpu"`` (tests only) times with the host clock in fp32."""
    import time

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("plan perf --measure needs a CUDA GPU and none is available; "
                        "run without --measure for the CPU-only roofline projection")
    from moetrain.models.recompute import checkpoint
    from moetrain.models.rope import RopeParams
    from moetrain.models.transformer import DecoderLayer
    from moetrain.plan.memory import block_mode
    from moetrain.train.optim import DTYPES

    c = _local_config(cfg)
    m = c.model
    dev = torch.device(device)
    graphed = cfg.train.cuda_graph and device == "cuda"  # time replays, as train.cuda_graph runs them
    dtype = DTYPES[c.precision.dtype] if device == "cuda" else torch.float32
    cuda = device == "cuda"

    def stamp():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(a, b) -> float:
        return a.elapsed_time(b) / 1e3 if cuda else b - a
    kinds: dict[str, int] = {}
    for i in range(m.num_layers):
        kinds.setdefault("moe" if c.is_moe_layer(i) else "dense", i)
    B, S, H = c.train.micro_batch_size, c.train.seq_length, m.hidden_size
    rope_dim = m.qk_rope_head_dim if m.attention_type == "mla" else c.attn_head_dim
    cos, sin = RopeParams.from_model_config(m, rope_dim).tables(S, device=dev)
    out = {}
    for kind, layer_id in kinds.items():
        torch.manual_seed(0)
        with torch.device(dev):
            blk = DecoderLayer(c, kind == "moe", None)
        with torch.no_grad():
            for name, prm in blk.named_parameters():
                if "norm" in name:
                    prm.fill_(1.0)
                elif name.rsplit(".", 1)[-1] in ("bias", "b1", "b2"):
                    prm.zero_()
                else:
                    prm.normal_(0.0, m.init_std)
        blk.to(dtype).train()
        mode = block_mode(cfg, layer_id)
        blk.set_recompute(mode)
        hooks = _main_grad_hooks(c, blk)
        x = torch.randn(B, S, H, device=dev, dtype=dtype, requires_grad=True)

        def forward(blk=blk, x=x, mode=mode):
            return checkpoint(blk, x, cos, sin) if mode == "full" else blk(x, cos, sin)

        def backward(y):  # the block's aux losses reach its routers through y (moe.aux_loss)
            y.float().square().mean().backward()

        out[kind] = _median_fwd_bwd(forward, backward, (blk,), x, warmup, iters, stamp, elapsed, graphed)
        for handle in hooks:
            handle.remove()
        del blk, x, hooks
        if cuda:
            torch.cuda.empty_cache()
    out["head"] = _measure_head(c, dev, dtype, warmup, iters, stamp, elapsed, graphed)
    if cuda:
        torch.cuda.empty_cache()
    return out


def _measure_head(c: Config, dev, dtype, warmup: int, iters: int, stamp, elapsed,
                  graphed: bool = False) -> tuple[float, float]:
    """Final norm, logits (the output head) and the fp32 cross-entropy, as the model runs them."""
    import torch

    from moetrain.models.linear import Linear
    from moetrain.models.norm import RMSNorm
    from moetrain.models.transformer import cross_entropy

    m = c.model
    B, S, H, V = c.train.micro_batch_size, c.train.seq_length, m.hidden_size, m.vocab_size
    torch.manual_seed(0)
    with torch.device(dev):
        norm, head = RMSNorm(H, m.norm_eps), Linear(H, V)
    with torch.no_grad():
        head.weight.normal_(0.0, m.init_std)
    norm.to(dtype)
    head.to(dtype)
    hooks = _main_grad_hooks(c, norm) + _main_grad_hooks(c, head)
    x = torch.randn(B, S, H, device=dev, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (B, S), device=dev)
    try:
        return _median_fwd_bwd(lambda: cross_entropy(torch.nn.functional.linear(norm(x), head.weight), labels),
                               lambda loss: loss.backward(), (norm, head), x, warmup, iters, stamp, elapsed, graphed)
    finally:
        for handle in hooks:
            handle.remove()


def _main_grad_hooks(c: Config, module) -> list:
    """The trainer's main-gradient hooks on ``module``'s parameters (optim.main_grads_dtype differing from the
    parameter dtype): the timed backward then includes their accumulation kernels and host time, as in a
    training step. Returns the hook handles."""
    from moetrain.train.optim import DTYPES, attach_main_grad

    grad_dtype = DTYPES[c.optim.main_grads_dtype]
    return [attach_main_grad(p, grad_dtype)[1] for p in module.parameters() if p.requires_grad and p.dtype != grad_dtype]


def _median_fwd_bwd(forward, backward, modules, x, warmup: int, iters: int, stamp, elapsed,
                    graphed: bool = False) -> tuple[float, float]:
    """Median (forward, backward) seconds of ``backward(forward())`` after ``warmup`` calls; gradients of
    ``modules`` and ``x`` dropped after each call. No synchronisation inside the loop: as in training,
    the host runs ahead of the GPU. ``graphed`` (train.cuda_graph, CUDA): the forward and the backward are
    captured as two CUDA graphs sharing one memory pool and their replays are timed."""
    import torch

    def drop_grads():
        for module in modules:
            module.zero_grad(set_to_none=True)
        x.grad = None

    run_forward, run_backward = forward, backward
    if graphed:
        from moetrain.train.graphed_step import on_side_stream

        def warm_up():
            for _ in range(max(warmup, 1)):
                backward(forward())
                drop_grads()

        on_side_stream(warm_up, x.device)  # off the capture, then capture
        g_fwd, g_bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_fwd):
            static_out = forward()
        with torch.cuda.graph(g_bwd, pool=g_fwd.pool()):
            backward(static_out)
        run_forward, run_backward = g_fwd.replay, lambda _: g_bwd.replay()
    stamps = []
    for it in range(warmup + iters):
        e0 = stamp()
        out = run_forward()
        e1 = stamp()
        run_backward(out)
        e2 = stamp()
        if it >= warmup:
            stamps.append((e0, e1, e2))
        if not graphed:  # a replay rewrites the gradients the capture allocated: keep them
            drop_grads()
    if x.is_cuda:
        torch.cuda.synchronize()
    return (statistics.median(elapsed(a, b) for a, b, _ in stamps),
            statistics.median(elapsed(b, e) for _, b, e in stamps))
