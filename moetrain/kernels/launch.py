"""Kernel launches with less host work than ``kernel[grid](...)``: ``launch(kernel, grid, *args, **kwargs)``.

Why: on the H200's host an eager MoE layer call spends 40-160 us per Triton or Gluon launch inside the call, 19
launches per forward + backward, and in an eager call from an idle GPU the GPU waits for every one of them before FC1
(bench/host_overhead.md). Triton 3.6's ``kernel[grid](...)`` runs its Python binder (the specialization of
every argument), a cache-key computation and its launch metadata, calls the (empty) launch hook chains, and its C
launcher asks the driver about every pointer argument (cuPointerGetAttribute, ~2 us each). A launch of the compiled
kernel with the pointers as integers skips all of that: 7-8 us against 24-30 for eight pointers in a loop, and in
the layer call (`moetrain bench host --launches triton,direct`) the launches take ~1.3 ms of host time per forward +
backward at Qwen3 and GPT-OSS against ~1.7 through Triton (bench/host_overhead.md).

How: the first call with a given specialization launches through Triton (which compiles or finds the kernel) and
keeps the compiled kernel under a key made of what Triton specializes on, conservatively: each tensor's dtype,
device kind and 16-byte alignment, each integer's equality with 0 and 1, divisibility by 16 and 32-bit range, each
TensorDescriptor's dtype, block shape, layout, padding and alignments, every keyword argument's value (constexprs
and launch options), and the current device. A key finer than Triton's only costs an extra cache entry. The GPU
tests check that the kept kernel is the one Triton's own binder picks, over aligned and misaligned tensors and every
integer class, and that a layer call computes the same bits launched either way (tests/kernels/test_launch_gpu.py).
Later calls hand the kernel's launcher the tensors' addresses.

Triton's path is taken as is under the interpreter (TRITON_INTERPRET), when a launch hook is set (profilers such as
proton), and with a Triton other than 3.6 (the launcher's calling convention is Triton's internal one; a warning
says so once). Not seen after a kernel's first launch: Triton knobs that change how it compiles (triton.knobs
runtime.debug, the instrumentation mode) set later in the process; set them before the first launch.
"""

from __future__ import annotations

import warnings

import torch

SUPPORTED_TRITON = "3.6."  # the launcher calling convention this module was written against

# (kernel, device, spec of the arguments, keyword arguments) -> (CompiledKernel, the values of the parameters after
# the positional ones: the keywords are in the key, so they are the same for every call under it)
_kernels: dict = {}
_direct: bool | None = None  # whether direct launches apply (decided on the first launch)
_runtime_knobs = None  # triton.knobs.runtime (its launch hooks), once triton is imported
_enabled = True  # use_direct(False): every launch through Triton (A/B timing of the host's launch cost)


def use_direct(on: bool) -> None:
    """Direct launches on (the default, where they apply) or off: for timing the host's launch cost both ways in one
    process (`moetrain bench host --launches`)."""
    global _enabled
    _enabled = bool(on)


def _direct_launches() -> bool:
    global _direct, _runtime_knobs
    if _direct is None:
        import triton

        from moetrain.kernels.grouped_gemm_configs import interpreting

        _runtime_knobs = triton.knobs.runtime
        _direct = not interpreting() and triton.__version__.startswith(SUPPORTED_TRITON)
        if not interpreting() and not _direct:
            warnings.warn(f"moetrain.kernels.launch: triton {triton.__version__} is not {SUPPORTED_TRITON}x: kernels "
                          "launch through triton's own path (correct, with more host time per launch)", stacklevel=3)
    return _direct


def _hooked(*hooks) -> bool:
    """Whether a launch hook is set: Triton 3.6's are chains (HookChain), empty unless a profiler added one."""
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _arg_spec(arg):
    """What Triton may specialize a kernel on in one positional argument (a superset of it)."""
    if isinstance(arg, torch.Tensor):  # (is_cuda: a CPU tensor goes through Triton, which refuses it clearly)
        return arg.dtype, arg.is_cuda, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None or isinstance(arg, float):
        return type(arg), arg if isinstance(arg, bool) else None
    if isinstance(arg, int):
        return int, arg == 0, arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31
    if hasattr(arg, "block_shape"):  # a host TensorDescriptor (triton.tools or gluon)
        return (type(arg), arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.block_shape),
                getattr(arg, "layout", None), arg.padding, tuple((s == 1, s % 16 == 0) for s in arg.shape),
                tuple((s == 1, s % 16 == 0) for s in arg.strides))
    raise TypeError(f"moetrain.kernels.launch: unexpected kernel argument of type {type(arg).__name__}")


def kernel_key(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    """The key a launch's compiled kernel is kept under (see the module docstring)."""
    return kernel, device, tuple(_arg_spec(a) for a in args), tuple(kwargs.items())


def _launch_value(arg):
    return arg.data_ptr() if isinstance(arg, torch.Tensor) else arg


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` for a @triton.jit or @gluon.jit function: the kernel's runtime arguments
    positional, its constexprs and launch options (num_warps, maxnreg, ...) as keywords; grid a tuple of 1-3 ints.
    See the module docstring."""
    if not _enabled or not _direct_launches() or _hooked(_runtime_knobs.launch_enter_hook,
                                                         _runtime_knobs.launch_exit_hook):
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    key = kernel_key(kernel, device, args, kwargs)
    kept = _kernels.get(key)
    if kept is None:  # Triton compiles (or finds) it, and launches
        runtime = [p.name for p in kernel.params if not p.is_constexpr and p.name in kwargs]
        if runtime:  # a tensor's identity in the key: every call a new entry
            raise ValueError(f"moetrain.kernels.launch: {kernel.__name__}'s runtime arguments {runtime} must be "
                             "positional (keywords are for constexprs and launch options)")
        missing = [p.name for p in kernel.params[len(args):] if p.name not in kwargs]
        if missing:  # the direct launches pass every parameter; a default would be Triton's to fill in
            raise ValueError(f"moetrain.kernels.launch: {kernel.__name__}'s parameters {missing} must be passed "
                             "(constexprs by keyword, defaults included)")
        _kernels[key] = (kernel[grid](*args, **kwargs), tuple(kwargs[p.name] for p in kernel.params[len(args):]))
        return
    compiled, trailing = kept
    g = tuple(grid) + (1, 1)
    compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *[_launch_value(a) for a in args], *trailing)


def cached_kernels() -> dict:
    """The kept compiled kernels by key (for the GPU tests)."""
    return {key: compiled for key, (compiled, _) in _kernels.items()}
