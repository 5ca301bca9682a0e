"""The hooks `moetrain bench host` and `moetrain bench gaps` put into our eager MoE layer call, and the call itself.

    WRAPPED                 "module:function" of the layer's host-side pieces (nested ones report inclusive times)
    wrap_functions(wrap)    replace each WRAPPED function, in every module that imported it by name, by wrap(name, fn);
                            returns the names not found (the layer's code moved on: say so, do not fail)
    wrap_launches(wrap)     the same for every Triton / Gluon launch ("launch KERNEL") and torch._grouped_mm
    one_call(fn, args)      one forward + backward as `bench moe` runs it: host seconds of each, and CUDA events

No profiler: a wrapper costs ~1 us per wrapped call, where the profiler's Python tracer slowed the host several-fold.
"""

from __future__ import annotations

import importlib
import sys
import time

import torch

WRAPPED = (
    "moetrain.ops.router_gemm:router_logits",
    "moetrain.ops.route:route",
    "moetrain.ops.moe:moe_experts",
    "moetrain.kernels.sort_rows:sort_rows",
    "moetrain.ops.moe:_live_weight",
    "moetrain.kernels.sort_rows:routing_weight_grad",
    "moetrain.ops.moe_fused:fc1_swiglu",
    "moetrain.ops.moe_fused:_fused_forward",
    "moetrain.kernels.rowgroup_pingpong:grouped_gemm_fc1_swiglu_pingpong",
    "moetrain.ops.grouped_gemm:grouped_gemm_op",
    "moetrain.ops.moe_rows:combine",
    "moetrain.ops.moe_rows:swiglu_backward",
    "moetrain.kernels.route:route_backward",
    "moetrain.ops.moe_fused:_fc1_backward",
    "moetrain.tuning.tuner:choose",
    "moetrain.kernels.grouped_gemm:_tuned",
    "moetrain.kernels.gluon_descs:descriptor",
)


def wrap_functions(wrap, specs=WRAPPED) -> list[str]:
    """Replace each "module:function" of ``specs`` by ``wrap(function name, original)`` in its module and in every
    loaded module that holds the same object under that name (``from m import f`` copies); the specs whose module or
    function does not exist are returned, untouched."""
    missing = []
    for spec in specs:
        modname, attr = spec.split(":")
        try:
            orig = getattr(importlib.import_module(modname), attr)
        except (ImportError, AttributeError):
            missing.append(spec)
            continue
        wrapped = wrap(attr, orig)
        for module in list(sys.modules.values()):
            if module is not None and _attribute(module, attr) is orig:
                setattr(module, attr, wrapped)
    return missing


def _attribute(module, attr: str):
    """module.attr, or None where it is missing or its lookup fails (lazy modules, e.g. transformers', import on
    attribute access and may miss optional dependencies)."""
    try:
        return getattr(module, attr, None)
    except Exception:
        return None


def wrap_launches(wrap) -> None:
    """Every Triton / Gluon launch (JITFunction.run, and kernels.launch.launch where the kernel modules imported it by
    name) as "launch KERNEL", and torch._grouped_mm, each replaced by ``wrap(name, call)()`` around the call."""
    from triton.runtime.jit import JITFunction

    from moetrain.kernels import launch as kernel_launch

    run = JITFunction.run
    direct = kernel_launch.launch
    inside = []  # a direct launch's first call goes through JITFunction.run: counted once, as the launch

    def wrapped_run(self, *args, **kwargs):
        if inside:
            return run(self, *args, **kwargs)
        return wrap("launch " + self.fn.__name__, lambda: run(self, *args, **kwargs))()

    def wrapped_launch(kernel, grid, *args, **kwargs):
        def call():
            inside.append(1)
            try:
                return direct(kernel, grid, *args, **kwargs)
            finally:
                inside.pop()
        return wrap("launch " + kernel.__name__, call)()

    JITFunction.run = wrapped_run
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "launch", None) is direct:
            module.launch = wrapped_launch
    torch._grouped_mm = wrap("torch._grouped_mm", torch._grouped_mm)


def one_call(fn, args, phase=lambda name: None, lead_in=None) -> tuple[float, float, torch.cuda.Event,
                                                                         torch.cuda.Event]:
    """One forward + backward of ``fn`` on bench moe's layer inputs: (host seconds to issue the forward, then the
    backward; start and end events, not yet synchronized). ``phase("forward")`` / ``phase("backward")`` is called as
    each begins; ``lead_in()``, when given, queues GPU work before the start event (bench moe's host-ahead)."""
    x, router_w, forcing, w1, w2, K, grad_out = args
    for t in (x, w1, w2):
        t.grad = None
    if lead_in is not None:
        lead_in()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    phase("forward")
    out = fn(x, router_w, forcing, w1, w2, K)
    t1 = time.perf_counter()
    phase("backward")
    out.backward(grad_out)
    t2 = time.perf_counter()
    end.record()
    return t1 - t0, t2 - t1, start, end
