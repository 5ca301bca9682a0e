"""Where a training step's GPU time goes: each kernel of a profiler trace put in one class by its name.

The classes follow the step's parts: the routed experts' GEMMs (our grouped
kernels, or torch's grouped_mm for the peer), the dense GEMMs (cuBLAS / CUTLASS: attention projections, shared
experts, the head), attention, the loss, the optimizer and grad norm, routing and row movement, the fused row kernels
(norms, RoPE, activations), and the rest (elementwise, copies, reductions). The first class whose pattern matches
wins, so the specific patterns come before the generic ones. Names that match none land in "other": a class that
grows there is the cue to add a pattern, not to guess. torch's softmax kernels count as the loss (the peer's router
softmax over a few experts' columns is small beside the [T, V] one).
"""

from __future__ import annotations

import re

_PATTERNS = (
    ("expert GEMMs", r"rowgroup|_wgrad|grouped_(mx|blockwise)|grouped_mm|grouped_gemm"),
    ("attention", r"flash|fmha|attention|attn"),
    ("loss", r"^_(stats|grad|fused)_kernel$|cross_entropy|nll_loss|log_softmax|softmax"),
    ("optimizer + grad norm", r"adamw|_sq_partials|_row_sums|multi_tensor_apply|foreach|lpnorm"),
    ("routing, gathers, scatters", r"_route|_skew_schedule|_chunk_counts|_place_rows|_weight_grad_kernel|_combine|"
                                   r"topk|sort|scatter|gather|index|histc|cumsum"),
    ("norms, RoPE, activations", r"_rope|_swiglu|rms|layer_norm|silu|gelu"),
    ("dense GEMMs", r"nvjet|gemm|xmma|cutlass|cublas|sm90_|splitk"),
    ("fp8 quantization", r"quantize|_e8m0|_scale_and_inverse"),
)
KERNEL_CLASSES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (label, re.compile(pattern, re.IGNORECASE)) for label, pattern in _PATTERNS)
OTHER = "other (elementwise, copies, reductions)"


def kernel_class(name: str) -> str:
    """The class of one kernel name (the first matching pattern of KERNEL_CLASSES, else OTHER)."""
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return OTHER


def by_class(totals: dict[str, float]) -> dict[str, float]:
    """Kernel name -> time, summed per class; classes with time only, largest first."""
    sums: dict[str, float] = {}
    for name, dur in totals.items():
        label = kernel_class(name)
        sums[label] = sums.get(label, 0.0) + dur
    return dict(sorted(sums.items(), key=lambda kv: -kv[1]))
