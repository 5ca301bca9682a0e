"""Public functional ops with autograd: what the models call. The backend is chosen here,
never in model code.

Legend: T tokens, H hidden, I expert intermediate, E experts (= G groups), K top-k,
M routed rows (T*K), N output features.

The kernels behind these ops are torch.library custom ops (moetrain.ops.custom_ops), so torch.compile traces
the MoE layer; ``defer_weight_grads`` splits their backward into input and weight gradients (moetrain.ops.deferred).
"""

from moetrain.ops.deferred import PendingWeightGrads, defer_weight_grads
from moetrain.ops.grouped_gemm import BACKENDS, grouped_gemm, resolve_backend
from moetrain.ops.moe import moe_experts, permute, swiglu, unpermute
from moetrain.ops.route import Routing, route
from moetrain.ops.router_gemm import router_logits

__all__ = ["BACKENDS", "PendingWeightGrads", "Routing", "defer_weight_grads", "grouped_gemm", "moe_experts", "permute",
           "resolve_backend", "route", "router_logits", "swiglu", "unpermute"]
