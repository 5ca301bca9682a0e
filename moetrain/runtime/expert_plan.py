"""The expert plan: which implementation runs each part of the MoE layer, decided in one place.

    expert_plan(backend, router_gemm, device=, dtype=, compiling=, triton=, tensor_core_mm=) -> ExpertPlan

The inputs are moe.backend ("auto" | "triton" | "torch" | "reference"; the grouped GEMM's "loop" is "reference"),
moe.router_gemm ("auto" | "fp32"), the device type ("cuda" | "cpu" | ...), the activation dtype's name ("fp32",
"bf16", "fp16", "fp64"), whether torch.compile is tracing the layer, whether triton imports, and whether this
torch has mm(out_dtype=). The layer's ops ask ``plan_for(x, backend, router_gemm)`` with their tensors at run
time; the planner (moetrain.plan) asks ``expert_plan`` with the configured dtype and device, so its projection
counts the kernels the run will launch. This module imports no torch at import time (the planner runs without it).

The rules:
- routing: the fused Triton routing kernel with backend triton, and with auto where it runs natively (CUDA,
  fp32/bf16/fp16, triton installed) outside torch.compile, which fuses PyTorch's routing itself; else PyTorch.
- router logits: the tensor-core GEMM (bf16 operands, fp32 out) on CUDA in bf16 outside torch.compile, unless
  router_gemm is fp32, the backend is the reference, or this torch lacks mm(out_dtype=); else fp32.
- expert GEMMs: triton -> our kernels; auto -> on CUDA in 16-bit with triton, the fused path with every GEMM and
  variant tuned per shape (moetrain.tuning), on CUDA otherwise torch._grouped_mm, off CUDA the loop reference;
  torch -> torch._grouped_mm; reference -> the loop.
- row ops (permute, SwiGLU, combine): Triton kernels exactly when the expert GEMMs are ours (the fused path).
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "triton", "torch", "reference")
ROUTER_GEMMS = ("auto", "fp32")
FUSED_DTYPES = ("bf16", "fp16")  # auto's fused path: our kernels' tile configs are tuned for 16-bit
ROUTING_DTYPES = ("fp32", "bf16", "fp16")  # the routing kernel's (fp64 stays on PyTorch)
_GEMM_OF_BACKEND = {"triton": "triton", "torch": "torch", "reference": "loop", "loop": "loop"}


@dataclass(frozen=True)
class ExpertPlan:
    """What runs each phase of one MoE layer (see the module docstring for why)."""

    routing: str  # ops.route impl: "triton" (one fused kernel) | "torch"
    logits: str  # ops.router_logits impl: "tensor_core" | "fp32"
    gemm: str  # grouped GEMM backend: "auto" (tuned per shape) | "triton" | "torch" | "loop"
    rows: str  # row ops' impl: "triton" | "torch"

    @property
    def fused(self) -> bool:
        """The fused expert path (ops.moe_experts: FC1 gathers token rows, FC2 is fused with the combine)."""
        return self.gemm in ("auto", "triton")


_PLANS: dict = {}  # a plain dict, not functools.lru_cache: torch.compile traces plan_for inside the layer


def expert_plan(backend: str = "auto", router_gemm: str = "auto", *, device: str = "cuda", dtype: str = "bf16",
                compiling: bool = False, triton: bool = True, tensor_core_mm: bool = True) -> ExpertPlan:
    """The plan for these inputs (one object per distinct question)."""
    key = (backend, router_gemm, device, dtype, compiling, triton, tensor_core_mm)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _decide(*key)
    return plan


def _decide(backend, router_gemm, device, dtype, compiling, triton, tensor_core_mm) -> ExpertPlan:
    if backend not in BACKENDS and backend != "loop":
        raise ValueError(f"unknown MoE backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if router_gemm not in ROUTER_GEMMS:
        raise ValueError(f"unknown router GEMM {router_gemm!r}; valid: {', '.join(ROUTER_GEMMS)}")
    cuda = device == "cuda"
    if backend == "auto":
        if not cuda:
            gemm = "loop"
        else:
            gemm = "auto" if dtype in FUSED_DTYPES and triton else "torch"
        native = cuda and dtype in ROUTING_DTYPES and triton and not compiling
        routing = "triton" if native else "torch"
    else:
        gemm = _GEMM_OF_BACKEND[backend]
        routing = "triton" if backend == "triton" else "torch"
    tensor_cores = (cuda and dtype == "bf16" and not compiling and tensor_core_mm and router_gemm == "auto"
                    and backend not in ("reference", "loop"))
    rows = "triton" if gemm in ("auto", "triton") else "torch"
    return ExpertPlan(routing=routing, logits="tensor_core" if tensor_cores else "fp32", gemm=gemm, rows=rows)


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> "bf16" (the config's names; "fp64" for float64)."""
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def plan_for(x, backend: str = "auto", router_gemm: str = "auto") -> ExpertPlan:
    """The plan for activations ``x`` (a torch.Tensor) now: its device and dtype, torch.compile's tracing state,
    triton's presence and this torch's mm(out_dtype=)."""
    import torch

    has_triton, tensor_core_mm = _environment()
    return expert_plan(backend, router_gemm, device=x.device.type, dtype=dtype_name(x.dtype),
                       compiling=torch.compiler.is_compiling(), triton=has_triton, tensor_core_mm=tensor_core_mm)


_ENVIRONMENT: list = []


def _environment() -> tuple[bool, bool]:
    """(triton imports, torch has mm(out_dtype=)): facts of the process, probed once. torch.compile takes the
    answer as a constant (torch.compiler.assume_constant_result) instead of tracing the probes."""
    if not _ENVIRONMENT:
        _ENVIRONMENT.append(_probe())
    return _ENVIRONMENT[0]


def _probe() -> tuple[bool, bool]:
    import torch

    from moetrain.runtime.packages import triton_available

    return triton_available(), "dtype" in torch.ops.aten.mm.overloads()
