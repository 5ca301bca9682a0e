"""Public functional ops with autograd: what the models call. The backend is chosen here,
never in model code.

Legend: T tokens, H hidden, I expert intermediate, E experts (= G groups), K top-k,
M routed rows (T*K), N output features.
"""

from moetrain.ops.grouped_gemm import BACKENDS, grouped_gemm, resolve_backend
from moetrain.ops.moe import moe_experts, permute, swiglu, unpermute
from moetrain.ops.route import Routing, route
from moetrain.ops.router_gemm import router_logits

__all__ = ["BACKENDS", "Routing", "grouped_gemm", "moe_experts", "permute", "resolve_backend", "route",
           "router_logits", "swiglu", "unpermute"]
