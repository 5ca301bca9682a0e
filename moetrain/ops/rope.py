"""RoPE with the optional per-head RMSNorm before it, as one autograd op over the fused Triton kernels
(moetrain.kernels.rope), and its eager reference.

Legend: B batch, S sequence, h heads, D rotary dim (even; the "two halves" layout of models.rope).

    fused_rope(x, cos, sin, weight=None, eps=1e-6) -> y
        x [B, S, h, D] bf16/fp16/fp32, any strides with the last dim contiguous (a view of a projection's output:
        GQA's q/k, MLA's q_rope and its shared k_rope [B, S, 1, D]); cos, sin fp32 [S, D/2] (RopeParams.tables);
        weight [D] (the norm's, any float dtype) or None -> y [B, S, h, D] contiguous in x's dtype:
        apply_rope(rms_norm(x, weight, eps), cos, sin), or apply_rope(x, cos, sin) without a weight. Differentiable
        in x and weight (dweight accumulated in fp32 over all rows, in a fixed order, cast to weight's dtype).
    rope_reference(x, cos, sin, weight=None, eps=1e-6) -> y
        the same function as the models' eager code computes it (models.norm.rms_norm, then models.rope.apply_rope).
    fused_rope_runs_here(x, cos) -> bool
        whether the attention modules take fused_rope for x and the tables: x a CUDA tensor of fp32/bf16/fp16, the
        tables fp32, triton installed.

Where the two round differently is in moetrain.kernels.rope's doc. What the op keeps for backward: with a weight,
x itself (the projection output it is a view of, in x's dtype) and the fp32 rstd per row [B, S, h]; without one,
nothing of its own; the tables, and the weight (a parameter), by reference (the model's fp32 tables are shared by
every layer). The eager path keeps the norm's fp32 copy, fp32 normalised tensor and rsqrt (8 D + 4 bytes per row,
plus an fp32 copy of a 16-bit weight) and, in 16-bit, cos/sin cast to x's dtype per call (plan.activations).

The kernels are the custom ops ``rope_fwd`` and ``rope_bwd`` (moetrain.ops.custom_ops), so torch.compile traces
through them.
"""

from __future__ import annotations

import torch

from moetrain.models.norm import rms_norm
from moetrain.models.rope import apply_rope
from moetrain.ops.custom_ops import kernel_op

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON: list = []  # whether triton imports, probed once (a plain list: torch.compile reads it as a constant)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """y [B, S, h, D] in x's dtype: the eager models' RMSNorm (fp32, when a weight is given) then RoPE in x's dtype."""
    if weight is not None:
        x = rms_norm(x, weight, eps)
    return apply_rope(x, cos, sin)


def fused_rope_runs_here(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the fused kernels run on x with the tables cos (and sin): x a CUDA tensor of fp32/bf16/fp16, the
    tables fp32, triton installed. (The tests force the CPU interpreter through here.)"""
    if x.device.type != "cuda" or x.dtype not in FUSED_DTYPES or cos.dtype != torch.float32:
        return False
    if not _TRITON:
        from moetrain.runtime.packages import triton_available

        _TRITON.append(triton_available())
    return _TRITON[0]


def _kernels():
    """moetrain.kernels.rope, imported on first use (it imports triton)."""
    from moetrain.kernels import rope

    return rope


# ---- the kernels as custom ops ---------------------------------------------------------------------------------

def _rope_fwd_fake(x, cos, sin, weight, eps):
    y = x.new_empty(x.shape)
    return [y] if weight is None else [y, x.new_empty(x.shape[:-1], dtype=torch.float32)]


@kernel_op("rope_fwd", fake=_rope_fwd_fake)
def rope_fwd_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None,
                    eps: float) -> list[torch.Tensor]:
    """[y [B, S, h, D] contiguous in x's dtype] and, with a weight, rstd fp32 [B, S, h] after it."""
    y, rstd = _kernels().rope_fwd(x, cos, sin, weight, eps)
    return [y] if rstd is None else [y, rstd]


def _rope_bwd_fake(dy, x, cos, sin, weight, rstd):
    dx = dy.new_empty(dy.shape)
    return [dx] if weight is None else [dx, dy.new_empty(dy.shape[-1:], dtype=torch.float32)]


@kernel_op("rope_bwd", fake=_rope_bwd_fake)
def rope_bwd_kernel(dy: torch.Tensor, x: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    weight: torch.Tensor | None, rstd: torch.Tensor | None) -> list[torch.Tensor]:
    """[dx [B, S, h, D] contiguous in dy's dtype] and, with a weight, dweight fp32 [D] after it; x and rstd (the
    forward's input and its rstd) are read only with a weight."""
    dx, dw = _kernels().rope_bwd(dy, x, cos, sin, weight, rstd)
    return [dx] if dw is None else [dx, dw]


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, weight, eps):
        outs = rope_fwd_kernel(x, cos, sin, weight, eps)
        if weight is None:
            ctx.save_for_backward(cos, sin)
        else:
            ctx.save_for_backward(cos, sin, x, weight, outs[1])
        return outs[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        cos, sin, *norm = ctx.saved_tensors
        x, weight, rstd = norm if norm else (None, None, None)
        outs = rope_bwd_kernel(dy, x, cos, sin, weight, rstd)
        dweight = outs[1].to(weight.dtype) if weight is not None and ctx.needs_input_grad[3] else None
        return outs[0], None, None, dweight, None


def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
               eps: float = 1e-6) -> torch.Tensor:
    """y = RoPE(RMSNorm(x)) (RoPE(x) without a weight) in one kernel per direction: shapes and dtypes in the module
    doc; the same function as ``rope_reference`` within the roundings kernels.rope's doc lists."""
    return _FusedRope.apply(x, cos, sin, weight, float(eps))
