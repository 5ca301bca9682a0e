"""Grouped GEMM: y[rows of group g] = x[rows of group g] @ w[g]^T.

Shapes and dtypes:
    x    [M, K]    float32 / bfloat16 / float16, rows sorted by group
    w    [G, N, K] same dtype as x
    offs [G]       int32, cumulative row ends: group g owns rows offs[g-1]..offs[g]-1
                   (offs[-1] may be < M: trailing rows belong to no group; their output is 0)
    y    [M, N]    dtype of x

Backends:
    "loop"  : a per-group Python loop of plain matmuls. Obviously correct; reads offs on the host
              (a device sync), so it is the reference, not the production path.
    "torch" : torch._grouped_mm for each of forward, dgrad and wgrad (sync-free; CUDA, or CPU in fp32
              with 16-byte aligned rows: torch 2.13's CPU _grouped_mm takes no fp64). Called by our
              autograd node, not through torch's autograd of _grouped_mm (whose CPU backward mishandles
              empty groups in torch 2.13, and whose weight gradient comes transposed).
    "triton": our persistent Triton kernels (moetrain.kernels.grouped_gemm: forward, dgrad, wgrad),
              sync-free. Needs the triton package and a CUDA device, or TRITON_INTERPRET=1 (set
              before triton is imported) to run them on CPU tensors in Triton's interpreter.
    "auto"  : on CUDA, for each of forward, dgrad and wgrad separately, per shape, the tuner's pick
              (moetrain.tuning) among torch._grouped_mm and our kernels' tile configs, measured once and
              cached on disk; torch where triton is not installed; "loop" off CUDA.

Every backend but "loop" runs its GEMMs through custom ops (moetrain.ops.custom_ops), so torch.compile
traces it whole (fullgraph), and may defer the weight gradient (moetrain.ops.deferred). "loop" is plain
PyTorch with PyTorch's autograd; under torch.compile its host read of offs is a graph break.
"""

from __future__ import annotations

import os

import torch

from moetrain.errors import UserError
from moetrain.kernels.torch_grouped_mm import torch_grouped_mm  # plain torch, no triton
from moetrain.ops.custom_ops import kernel_op
from moetrain.ops.deferred import weight_grad
from moetrain.runtime.packages import triton_available

BACKENDS = ("auto", "torch", "triton", "loop")
# The MoE config says "reference" for the loop backend.
_ALIASES = {"reference": "loop"}


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map a requested backend to the one that runs on ``device``; unknown names are errors.

    Without a shape, "auto" means torch on CUDA; ``grouped_gemm`` and ``moe_experts`` resolve
    "auto" per shape themselves (moetrain.tuning)."""
    backend = _ALIASES.get(backend, backend)
    if backend == "auto":
        return "torch" if device.type == "cuda" else "loop"
    if backend == "triton":
        require_triton(device)
        return "triton"
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped GEMM backend {backend!r}; valid: {', '.join(BACKENDS)}, reference")
    return backend


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend: str = "auto",
                 recipe: str = "none") -> torch.Tensor:
    """y_g = x_g @ w_g^T for each group g (see module docstring for shapes). ``recipe`` other than "none": in FP8
    (``ops.grouped_gemm_fp8``: the recipe decides the kernels; ``backend`` applies to the 16/32-bit GEMMs)."""
    if recipe != "none":
        from moetrain.ops.grouped_gemm_fp8 import grouped_gemm_fp8

        return grouped_gemm_fp8(x, w, offs, recipe)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not match ([M,K], [G,N,K])")
    if offs.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm: offs {tuple(offs.shape)} must be [G] = [{w.shape[0]}]")
    if _ALIASES.get(backend, backend) == "auto" and x.device.type == "cuda":
        return _PerOpGroupedGemm.apply(x, w, offs, "auto")
    which = resolve_backend(backend, x.device)
    if which == "loop":
        return grouped_gemm_loop(x, w, offs)
    return _PerOpGroupedGemm.apply(x, w, offs, which)


# ---- each of the three GEMMs on its own backend ---------------------------------------------
# The forward, the data gradient and the weight gradient have different shapes and different
# winners (on the H200 at Qwen3 shapes: torch for the FC1 forward, Triton for the other five),
# so with backend "auto" each op is tuned on its own (tuning kinds gemm_fwd+torch, gemm_dgrad+torch,
# gemm_wgrad+torch).
#   fwd   y  [M, N] = x_g  @ w[g]^T      (a = x,  b = w)
#   dgrad dx [M, K] = dy_g @ w[g]        (a = dy, b = w)
#   wgrad dw [G,N,K] = dy_g^T @ x_g      (a = dy, b = x)


def _run_op(op: str, backend: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if backend == "torch":
        return torch_grouped_mm(op, a, b, offs)
    if backend in ("triton", "auto"):
        # imports triton: only when chosen. "auto": the tuner picks among torch and our configs in the kernel's entry
        from moetrain.kernels import grouped_gemm as kernels

        return getattr(kernels, f"grouped_gemm_{op}")(a, b, offs, with_torch=backend == "auto")
    if op == "fwd":
        return grouped_gemm_loop(a, b, offs)
    if op == "dgrad":
        return grouped_gemm_loop(a, b.transpose(1, 2), offs)
    return _wgrad_loop(a, b, offs)


def _wgrad_loop(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    dw = dy.new_zeros(offs.shape[0], dy.shape[1], x.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        dw[g] = dy[start:end].t() @ x[start:end]
        start = end
    return dw


def grouped_gemm_op(op: str, backend: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One of the three GEMMs (op: fwd, dgrad, wgrad; see above) on ``backend``: triton, torch, loop, or
    auto (this op's tuned winner at this shape; torch without triton). The eager body of the three custom ops
    below."""
    if backend == "auto" and not triton_available():
        backend = "torch"
    return _run_op(op, backend, a, b, offs)


# The three GEMMs as custom ops (moetrain.ops.custom_ops): offs [G] int32; backend as grouped_gemm_op's.
@kernel_op("grouped_gemm_fwd", fake=lambda x, w, offs, backend: x.new_empty(x.shape[0], w.shape[1]))
def gemm_fwd(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    """y [M, N] = x_g @ w[g]^T: x [M, K], w [G, N, K] -> x's dtype."""
    return grouped_gemm_op("fwd", backend, x, w, offs)


@kernel_op("grouped_gemm_dgrad", fake=lambda dy, w, offs, backend: dy.new_empty(dy.shape[0], w.shape[2]))
def gemm_dgrad(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    """dx [M, K] = dy_g @ w[g]: dy [M, N], w [G, N, K] -> dy's dtype."""
    return grouped_gemm_op("dgrad", backend, dy, w, offs)


@kernel_op("grouped_gemm_wgrad",
           fake=lambda dy, x, offs, backend: dy.new_empty(offs.shape[0], dy.shape[1], x.shape[1]))
def gemm_wgrad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, backend: str) -> torch.Tensor:
    """dw [G, N, K] = dy_g^T @ x_g: dy [M, N], x [M, K], G = offs' length -> dy's dtype."""
    return grouped_gemm_op("wgrad", backend, dy, x, offs)


class _PerOpGroupedGemm(torch.autograd.Function):
    """y = x_g @ w_g^T where forward, dgrad (dy_g @ w_g) and wgrad (dy_g^T @ x_g) each run ``backend``:
    "triton" (our kernels), "torch" (torch._grouped_mm) or "auto" (each op its own measured winner). Nothing
    reads offs on the host. The weight gradient may be deferred (moetrain.ops.deferred)."""

    @staticmethod
    def forward(ctx, x, w, offs, backend):
        offs = offs.to(torch.int32)
        ctx.save_for_backward(x, w, offs)
        ctx.backend = backend
        return gemm_fwd(x, w, offs, backend)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy, backend = dy.to(x.dtype).contiguous(), ctx.backend
        dx = gemm_dgrad(dy, w, offs, backend) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = weight_grad(ctx, 1, lambda: gemm_wgrad(dy, x, offs, backend))
        return dx, dw, None, None


def require_triton(device: torch.device) -> None:
    """The triton backend needs the package, and a CUDA device or the CPU interpreter."""
    if not triton_available():
        raise UserError("backend 'triton' (our MoE kernels) needs the triton package (pip install triton); "
                        "use backend auto, torch or reference")
    if device.type == "cuda":
        return
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes"):
        return
    raise UserError(f"backend 'triton' (our MoE kernels) needs a CUDA device (tensors are on {device}); "
                    "set TRITON_INTERPRET=1 before importing triton to run its CPU interpreter, "
                    "or use backend auto, torch or reference")


def grouped_gemm_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Reference: one matmul per group; autograd comes from the plain ops."""
    ends = offs.tolist()
    pieces, start = [], 0
    for g, end in enumerate(ends):
        pieces.append(x[start:end] @ w[g].t())
        start = end
    if start < x.shape[0]:
        pieces.append(x.new_zeros(x.shape[0] - start, w.shape[1]))
    return torch.cat(pieces, dim=0)
