"""Public functional ops with autograd: what the models call. The backend is chosen here,
never in model code.

Legend: T tokens, H hidden, I expert intermediate, E experts (= G groups), K top-k,
M routed rows (T*K), N output features, V vocabulary rows.

``linear_cross_entropy`` (moetrain.ops.linear_cross_entropy): the LM loss from h and the head's weight, chunked over
tokens, gradients computed in its forward, optionally vocab-parallel.

The kernels behind these ops are torch.library custom ops (moetrain.ops.custom_ops), so torch.compile traces
the MoE layer; ``defer_weight_grads`` splits their backward into input and weight gradients (moetrain.ops.deferred).
"""

from moetrain.ops.deferred import PendingWeightGrads, defer_weight_grads
from moetrain.ops.grouped_gemm import BACKENDS, grouped_gemm, resolve_backend
from moetrain.ops.linear_cross_entropy import (linear_cross_entropy, linear_cross_entropy_mean,
                                               linear_cross_entropy_reference)
from moetrain.ops.moe import moe_experts, permute, swiglu, unpermute
from moetrain.ops.route import Routing, route
from moetrain.ops.router_gemm import router_logits

__all__ = ["BACKENDS", "PendingWeightGrads", "Routing", "defer_weight_grads", "grouped_gemm", "linear_cross_entropy",
           "linear_cross_entropy_mean", "linear_cross_entropy_reference", "moe_experts", "permute", "resolve_backend",
           "route", "router_logits", "swiglu", "unpermute"]
