"""Our kernels as torch.library custom ops, so that torch.compile traces through the MoE layer.

Every kernel entry point of the expert and router path (the grouped GEMMs and the fused path's FC1 variants, the
row sort, SwiGLU, the combines, the token-row copy, the routing kernel and its backward, the router's tensor-core
GEMM) is registered as ``moetrain::<name>`` with a fake implementation that gives each output's exact shape and
dtype from the inputs' shapes alone: the MoE path is sync-free, so no output shape depends on the routing. Inside
torch.compile an op is one opaque node of the graph; the run-time choices made inside it (moetrain.tuning's picks of
backends, tile configs and variants) run when the compiled graph runs, on real tensors, exactly as in eager mode.

Autograd stays in our torch.autograd.Function classes, whose forward and backward call these ops (dynamo traces an
autograd.Function with its backward), rather than moving to ``register_autograd``: the backward has to decide at
run time whether to defer its weight gradient (moetrain.ops.deferred), the nodes choose what they save and mark
(set_materialize_grads(False), outputs that are not differentiable, one node for FC2 and the combine), and an op
with ``register_autograd`` is differentiable only when called through the dispatcher, which eager calls skip (next).

Eager calls skip the dispatcher. Through torch.ops a call costs about 9 us of host time more than calling its Python
implementation (this project's 2-core CPU, torch 2.13, ``grouped_gemm_fwd`` / ``_wgrad`` with the torch backend on
[16, 8] operands: 7.5-8.0 us direct, 16.5-17.8 us through torch.ops.moetrain, best of 5 x 5000 calls), and an eager
MoE layer at a small batch is host-bound with ~20 kernel calls per forward and backward (each PyTorch op already
costs the H200's host 25-160 us). So a ``kernel_op`` runs its implementation directly outside compilation (that
check costs < 0.5 us) and the registered op inside it: the same function body either way, so the same numbers.

Every op's implementation is fully annotated (the annotations make its schema) and returns new tensors (no output
aliases an input); optional outputs are returned as a list whose length the inputs decide (custom ops cannot
return None). An op that writes over an input names it in ``mutates_args`` (the fused loss's gradient kernels write
it over the logits, the point of the kernel: no second [C, V] buffer); its schema then says so, and functionalization
(torch.compile) sees the write.
"""

from __future__ import annotations

import torch

NAMESPACE = "moetrain"
# name -> the kernel_op function (its .op is the registered torch.ops overload, .impl the implementation, .fake the
# fake implementation): what the fake-tensor and opcheck tests walk
REGISTERED: dict = {}


def kernel_op(name: str, fake, mutates_args: tuple[str, ...] = ()):
    """Decorator: register ``impl`` as the custom op ``moetrain::<name>`` (mutating only the arguments named in
    ``mutates_args``, none by default) with ``fake`` as its fake implementation (the same signature; outputs from
    ``new_empty`` of the right shapes and dtypes), and return a function that calls ``impl`` directly in eager mode
    and the op under torch.compile (module docstring)."""

    def register(impl):
        defined = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=tuple(mutates_args))
        defined.register_fake(fake)
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default

        def call(*args):
            if torch.compiler.is_compiling():
                return overload(*args)
            return impl(*args)

        call.__name__ = call.__qualname__ = name
        call.__doc__ = impl.__doc__
        call.op, call.impl, call.fake = overload, impl, fake
        REGISTERED[name] = call
        return call

    return register
