"""Router logits in fp32: logits [T, E] = x [T, H] @ weight[E, H]^T (+ bias [E]).

Routing is decided in fp32 (top-k over near-equal logits is sensitive to rounding). The reference
("fp32") upcasts x and the weight and runs an fp32 GEMM: without TF32 that GEMM runs on the SIMT
units, and autograd keeps the fp32 copy of x (4*T*H bytes per MoE layer) for the weight gradient.
Measured on the H200 (bench moe --profile): 1.37 ms of DeepSeek-V3's 34 ms layer, 0.41 ms of Qwen3's 8.

"tensor_core" (bf16 x and weight on CUDA) gives the same logits on the tensor cores: the product of
two bf16 numbers is exact in fp32 and the GEMM accumulates in fp32 (torch.mm with out_dtype=fp32),
so only the order of summation differs from the reference. Its backward splits the fp32 logit
gradient g into g_hi = bf16(g) and g_lo = bf16(g - g_hi) (g_hi + g_lo carries 16 of fp32's 24
mantissa bits, far more than the bf16 gradients it produces) and runs bf16 GEMMs with fp32
accumulation: dx = [g_hi g_lo] @ [w; w] (one GEMM, bf16 out), dw = g_hi^T x + g_lo^T x (one GEMM of
[g_hi g_lo]^T x, its two halves added in fp32). g_hi and g_lo are written side by side into one
[T, 2E] buffer: the backward is 6 kernels (it was 12, at 50-80 us of host time each on the H200 host).
It saves x and w themselves (the MoE input is kept by the expert path anyway), no fp32 copies. Its two fp32-out
GEMMs are a custom op (``mm_fp32``: moetrain.ops.custom_ops), so impl "tensor_core" compiles too; its weight
gradient may be deferred (moetrain.ops.deferred).

impl "auto": tensor_core where it applies (CUDA, bf16 x and weight, outside torch.compile, which
compiles the reference itself), else fp32; should the tensor-core call fail (a torch without
mm(out_dtype=)), one warning and fp32 for the rest of the process. Shapes: x [T, H], weight [E, H], bias [E] or None ->
[T, E] fp32 (fp64 when x is fp64).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from moetrain.ops.custom_ops import kernel_op
from moetrain.ops.deferred import weight_grad
from moetrain.runtime.expert_plan import plan_for

IMPLS = ("auto", "fp32", "tensor_core")


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ b [k, n] of bf16 operands, accumulated and returned in fp32 (CUDA). Tests replace it
    with the exact-product CPU equivalent."""
    return torch.mm(a, b, out_dtype=torch.float32)


@kernel_op("router_mm_fp32", fake=lambda a, b: a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32))
def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``_mm_fp32_out`` as a custom op (a [m, k] @ b [k, n], bf16 -> fp32 [m, n]): the tensor-core path's forward
    and weight-gradient GEMMs, the same call compiled and eager."""
    return _mm_fp32_out(a, b)


_unsupported: str | None = None  # why the tensor-core GEMM failed in this process (auto then uses fp32)


def _give_up(err: Exception) -> None:
    global _unsupported
    _unsupported = f"{type(err).__name__}: {err}"[:300]
    warnings.warn(f"moetrain: the tensor-core router GEMM failed ({_unsupported}); router logits use the fp32 "
                  "GEMM for the rest of this process (moe.router_gemm=fp32 does so without trying)",
                  RuntimeWarning, stacklevel=3)


def _tensor_core(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = _TensorCoreRouterGemm.apply(x, weight)
    return logits if bias is None else logits + bias.float()


def tensor_core_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """auto's choice (runtime.expert_plan's router-logits rule), for a weight in x's bf16."""
    return weight.dtype == x.dtype and plan_for(x).logits == "tensor_core"


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  impl: str = "auto") -> torch.Tensor:
    """fp32 router logits (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown router GEMM implementation {impl!r}; valid: {', '.join(IMPLS)}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, H], [E, H]")
    if impl == "auto":
        if tensor_core_applies(x, weight) and _unsupported is None:
            try:
                return _tensor_core(x, weight, bias)
            except (RuntimeError, TypeError, NotImplementedError) as err:  # a torch without mm(out_dtype=)
                _give_up(err)
        impl = "fp32"
    if impl == "tensor_core":
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            raise ValueError(f"router_logits impl='tensor_core' needs bf16 x and weight, got {x.dtype}, {weight.dtype}")
        return _tensor_core(x, weight, bias)
    dt = torch.promote_types(x.dtype, torch.float32)
    return F.linear(x.to(dt), weight.to(dt), None if bias is None else bias.to(dt))


def split_bf16_cat(g: torch.Tensor) -> torch.Tensor:
    """fp32 g [..., E] -> [..., 2E] bf16 holding hi | lo, with hi + lo = g to about 2^-16 relative
    (hi = bf16(g), lo = bf16(g - hi)). The halves are written into one buffer, two ops and no cat, since
    every op costs 50-80 us of host time on the H200 host and the concatenation is the dx GEMM's operand.
    Under torch.compile (which refuses an out= into a strided view, and fuses the ops itself) the same values
    from the definition's casts and a cat."""
    if torch.compiler.is_compiling():
        hi = g.to(torch.bfloat16)
        return torch.cat([hi, (g - hi.float()).to(torch.bfloat16)], dim=-1)
    E = g.shape[-1]
    hilo = torch.empty(*g.shape[:-1], 2 * E, dtype=torch.bfloat16, device=g.device)
    hi, lo = hilo.split(E, dim=-1)
    hi.copy_(g)  # rounds to nearest, as g.to(bf16)
    torch.sub(g, hi, out=lo)  # computed in fp32 (exact: hi is g rounded), rounded to bf16 on the store
    return hilo


def split_bf16(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 g [..., E] -> (hi, lo) bf16 [..., E] with hi + lo = g to about 2^-16 relative (hi = bf16(g),
    lo = bf16(g - hi)): the halves of split_bf16_cat(g)."""
    return split_bf16_cat(g).split(g.shape[-1], dim=-1)


class _TensorCoreRouterGemm(torch.autograd.Function):
    """logits = x @ weight^T in fp32 from bf16 operands (module docstring); the weight's gradient may be deferred
    (moetrain.ops.deferred)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return mm_fp32(x, weight.t())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogits):
        x, weight = ctx.saved_tensors
        hilo = split_bf16_cat(dlogits.float())  # [T, 2E]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # bf16 out: the GEMM still accumulates in fp32 and rounds once, without an fp32 [T, H] to write,
            # read back and cast (0.05 ms and 128 MiB at Qwen3's T = 16384, H = 2048)
            dx = torch.mm(hilo, torch.cat([weight, weight], dim=0))
        if ctx.needs_input_grad[1]:
            dw = weight_grad(ctx, 1, lambda: _weight_grad(hilo, x, weight))
        return dx, dw


def _weight_grad(hilo: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dw [E, H] in weight's dtype from hilo [T, 2E] (the split logit gradient) and x [T, H]: one GEMM for hi^T x and
    lo^T x ([2E, H] fp32), whose halves are added in fp32 and rounded once on the store (the numerics of two GEMMs,
    an add and a cast, in two kernels instead of four)."""
    halves = mm_fp32(hilo.t(), x).split(weight.shape[0])
    return torch.add(*halves, out=torch.empty_like(weight))
