"""Precision-aware AdamW with optional fp32 master weights and low-precision state.

Three independent precision choices (``optim.*_dtype`` and ``precision.master_weights``):
- main gradients: where micro-batch gradients accumulate (fp32 or bf16). When it differs from
  the parameter dtype, a post-accumulate hook moves each gradient into the main buffer so the
  sum over micro-batches is kept in that dtype.
- master weights: an fp32 copy of every low-precision parameter that the update is applied
  to; the model parameter is then a rounded copy of it.
- Adam moments exp_avg / exp_avg_sq: stored in fp32 or bf16; the update math runs in fp32.

Three update paths, one definition (torch._fused_adamw_'s; ``adamw_reference`` is it per tensor):
- the Triton multi-tensor kernel (``moetrain.kernels.adamw``, glue in optim_kernels.py): every dtype combination,
  one launch per combination, each element read and written once, the rounded parameter copy written in the same
  pass; the gradients' norm one multi-tensor pass before it. On CUDA where triton is installed (``kernel=None``).
- torch's ``_fused_adamw_``: where the updated tensor, its gradient and both moments share one dtype (the CPU path,
  and CUDA without triton).
- the explicit per-tensor path (``adamw_reference``): mixed-precision state without the kernel; the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.config.schema import OptimConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wants_weight_decay(name: str, param: nn.Parameter) -> bool:
    """Matrices decay; norms, biases (incl. expert biases b1/b2), sinks and embeddings do not."""
    return decays(name, param.dim())


def decays(name: str, ndim: int) -> bool:
    """``wants_weight_decay`` of a parameter of ``ndim`` dimensions (any framework's)."""
    if ndim < 2:
        return False
    leaf = name.rsplit(".", 1)[-1]
    return leaf not in ("bias", "b1", "b2") and not name.startswith("embed.")


@dataclass
class _Slot:
    name: str
    param: nn.Parameter
    master: torch.Tensor | None  # fp32 copy the update is applied to; None: update the param itself
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: bool
    main_grad: torch.Tensor | None = None  # separate accumulation buffer, when used


class PrecisionAwareAdamW:
    """AdamW over named parameters with the precision choices described in the module doc.

    Usage per optimizer step: zero_grad(); backward over micro-batches; grads() -> clip ->
    step(lr). Gradients are read from ``main_grad`` buffers or ``param.grad``.
    """

    def __init__(self, named_params, optim: OptimConfig, master_weights: bool, fused: bool = True,
                 main_grad_hooks: bool = True, kernel: bool | None = None):
        """``main_grad_hooks=False``: gradients stay where the backward puts them (FSDP2 reduces them in the main
        gradient dtype itself). DTensor parameters (sharded) are updated through their local shards, and the
        moments and masters are local; ``norm_groups`` (set by the distributed trainer: one ``shard_groups`` tuple
        per slot) makes ``grad_norm`` global over ranks. Under pipeline parallelism each rank holds other parameters:
        ``norm_outer_group`` (the pipeline group) sums the ranks' shares, and ``norm_excluded`` names the slots whose
        gradient another rank already counts (a tied weight's second copy).

        ``kernel``: the Triton multi-tensor path for every slot whose tensors are contiguous; None: as
        optim.triton_kernel says (true: where they are on CUDA and triton is installed; false: never); True: on any
        device (the CPU under TRITON_INTERPRET, in tests); False: never. ``fused``: torch's fused AdamW where the dtypes agree (False, with kernel False: the explicit path
        for every slot). Both are plain attributes, read at every step (``moetrain bench optim`` switches them)."""
        self.cfg = optim
        self.kernel = kernel if kernel is not None else (None if optim.triton_kernel else False)
        self._kernel_path = None  # optim_kernels.KernelPath, made on first use
        self.norm_groups: list[tuple] | None = None
        self.norm_outer_group = None
        self.norm_excluded: set[str] = set()
        # torch's fused AdamW kernel (CPU and CUDA); fused=False forces the explicit path.
        self.fused = fused and hasattr(torch, "_fused_adamw_")
        self.step_count = 0
        self._device_step: torch.Tensor | None = None  # step_on_device's counter
        self._coverage: tuple | None = None  # (kernel setting, per slot: the kernel updates it)
        grad_dtype = DTYPES[optim.main_grads_dtype]
        self.slots: list[_Slot] = []
        self._hooks = []
        for name, p in named_params:
            if not p.requires_grad:
                continue
            low_precision = p.dtype != torch.float32
            local = _data(p)
            master = local.detach().float().clone() if (master_weights and low_precision) else None
            slot = _Slot(
                name=name, param=p, master=master,
                exp_avg=torch.zeros_like(local, dtype=DTYPES[optim.exp_avg_dtype]),
                exp_avg_sq=torch.zeros_like(local, dtype=DTYPES[optim.exp_avg_sq_dtype]),
                decay=(optim.weight_decay > 0
                       and (optim.decay_norms_biases_embeddings or wants_weight_decay(name, p))),
            )
            if main_grad_hooks and grad_dtype != p.dtype:
                slot.main_grad, handle = attach_main_grad(p, grad_dtype)
                self._hooks.append(handle)
            self.slots.append(slot)

    def close(self) -> None:
        """Remove the gradient hooks from the parameters (the model may live on without us)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ---- gradients -----------------------------------------------------------------

    def zero_grad(self) -> None:
        for s in self.slots:
            s.param.grad = None
        main = [s.main_grad for s in self.slots if s.main_grad is not None]
        if main:  # one multi-tensor launch, not one per tensor (host-bound small models feel the difference)
            torch._foreach_zero_(main)

    def grads(self) -> list[torch.Tensor | None]:
        """Each slot's gradient (its local shard for a DTensor parameter), or None."""
        return [s.main_grad if s.main_grad is not None else _data(s.param.grad) for s in self.slots]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients, in fp32, on the device (no host sync; over every rank's shards where
        ``norm_groups`` is set: one all-reduce per group of meshes)."""
        present = [(g, i) for i, g in enumerate(self.grads())
                   if g is not None and self.slots[i].name not in self.norm_excluded]
        if not present:
            return torch.zeros(())
        squares = self._squares(present)
        if self.norm_groups is None:
            return torch.stack([s.sum() for s, _ in squares]).sum().sqrt()
        from moetrain.distributed.reduce import global_sq_norm

        local = [(s[j], i) for s, slots in squares for j, i in enumerate(slots)]
        sq = global_sq_norm([s for s, _ in local], [self.norm_groups[i] for _, i in local])
        if self.norm_outer_group is not None:
            import torch.distributed as dist

            dist.all_reduce(sq, group=self.norm_outer_group)
        return sq.sqrt()

    def _squares(self, present: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, list[int]]]:
        """Sums of squares of the gradients ``present`` ((gradient, slot index)) in fp32: [(sums [k], their slot
        indices)], from the kernel's one pass where it covers the slot, else from torch._foreach_norm."""
        covered = self._covered()
        by_kernel = [(g if g.is_contiguous() else g.contiguous(), i) for g, i in present if covered[i]]
        rest = [(g, i) for g, i in present if not covered[i]]
        out = []
        if by_kernel:
            grads = [g for g, _ in by_kernel]
            out += [(s, [by_kernel[j][1] for j in idx]) for s, idx in self._kernels().sq_norms(grads)]
            done = {i for _, idx in out for i in idx}
            empty = [i for g, i in by_kernel if i not in done]  # left out of the kernel's table: no elements
            if empty:  # still counted, as 0: each rank must join the same norm groups' all-reduces
                out.append((torch.zeros(len(empty), device=grads[0].device), empty))
        if rest:  # accumulated and returned in fp32 (by default a bf16 gradient's norm would be rounded to bf16)
            norms = torch._foreach_norm([g for g, _ in rest], 2.0, dtype=torch.float32)
            out.append((torch.stack(norms).square(), [i for _, i in rest]))
        return out

    def scale_grads(self, factor: torch.Tensor | float) -> None:
        grads = [g for g in self.grads() if g is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    # ---- update --------------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """One AdamW update at learning rate ``lr``; parameters without a gradient are skipped.

        The paths (module doc): the Triton kernel for the slots it covers, torch's fused AdamW where the updated
        tensor, its gradient and both moments share one dtype (one launch per group instead of ~10 elementwise
        passes per tensor: at 3B parameters ~20 ms instead of ~60 ms on an H200), the explicit per-tensor path
        for the rest (mixed-precision state without the kernel), which does the same math in fp32.
        """
        self.step_count += 1
        kernel, fused = self._split(lambda s, target, grad: self.fused and _one_dtype(s, target, grad))
        for s, target, grad in fused.pop(None, []):
            self._step_explicit(s, target, grad, lr)
        steps: dict = {}
        for (device, _, decay), items in fused.items():
            step_t = steps.setdefault(device, _device_scalar(self.step_count, device))
            self._fused_adamw(items, step_t, lr, decay)
        for device, groups in kernel.items():
            self._kernels().update(groups, steps.setdefault(device, _device_scalar(self.step_count, device)),
                                   _device_scalar(lr, device), self._hyper())
        self._copy_masters()
        _weights_changed()

    def _split(self, fusable) -> tuple[dict, dict]:
        """The slots with a gradient, by path: ({device: {dtype key: kernel rows}}, {(device, dtype, decay): fused
        items, None: explicit items}); ``fusable(slot, target, grad)`` says whether torch's fused AdamW takes a
        slot the kernel does not."""
        covered = self._covered()
        kernel: dict = {}
        fused: dict = {}
        for i, (s, grad) in enumerate(zip(self.slots, self.grads())):
            if grad is None:
                continue
            target = s.master if s.master is not None else _data(s.param)
            if covered[i]:
                copy = _data(s.param) if s.master is not None else None
                grad = grad if grad.is_contiguous() else grad.contiguous()
                key = (target.dtype, grad.dtype, s.exp_avg.dtype, s.exp_avg_sq.dtype, copy.dtype if copy is not None
                       else None)
                kernel.setdefault(target.device, {}).setdefault(key, []).append(
                    (target, grad, s.exp_avg, s.exp_avg_sq, copy, s.decay))
            elif fusable(s, target, grad):
                fused.setdefault((target.device, target.dtype, s.decay), []).append((s, target, grad))
            else:
                fused.setdefault(None, []).append((s, target, grad))
        return kernel, fused

    def _fused_adamw(self, items: list[tuple[_Slot, torch.Tensor, torch.Tensor]], step_t: torch.Tensor,
                     lr: float | torch.Tensor, decay: bool, **scale_and_skip) -> None:
        """torch's fused AdamW over (slot, updated tensor, gradient) of one device, dtype and decay group."""
        torch._fused_adamw_(
            [t for _, t, _ in items], [g for _, _, g in items], [s.exp_avg for s, _, _ in items],
            [s.exp_avg_sq for s, _, _ in items], [], [step_t] * len(items),
            lr=lr, beta1=self.cfg.beta1, beta2=self.cfg.beta2,
            weight_decay=self.cfg.weight_decay if decay else 0.0, eps=self.cfg.eps,
            amsgrad=False, maximize=False, **scale_and_skip)

    def _copy_masters(self) -> None:
        covered = self._covered()  # the kernel writes its slots' parameters itself
        with_master = [s for s, k in zip(self.slots, covered) if s.master is not None and not k]
        if with_master:  # multi-tensor copy (and cast) of the updated master weights into the parameters
            torch._foreach_copy_([_data(s.param) for s in with_master], [s.master for s in with_master])

    # ---- the whole update on the device (train.cuda_graph captures it) ---------------

    def explicit_slots(self) -> list[str]:
        """Names of the parameters whose update takes the explicit per-tensor path, which reads the step count on
        the host: mixed-precision state that the kernel does not cover (no CUDA or no triton; ``kernel=False``)."""
        out = []
        for s, covered in zip(self.slots, self._covered()):
            target = s.master if s.master is not None else s.param
            grad_dtype = s.main_grad.dtype if s.main_grad is not None else s.param.dtype
            if not (covered or (self.fused and target.dtype == grad_dtype == s.exp_avg.dtype == s.exp_avg_sq.dtype)):
                out.append(s.name)
        return out

    # ---- the Triton path --------------------------------------------------------------

    def _covered(self) -> list[bool]:
        """Per slot, whether the kernel updates it (``kernel`` in __init__'s doc; the slot's tensors contiguous)."""
        if self._coverage is None or self._coverage[0] != self.kernel:
            self._coverage = (self.kernel, [self._kernel_takes(s) for s in self.slots])
        return self._coverage[1]

    def _kernel_takes(self, s: _Slot) -> bool:
        if self.kernel is False:
            return False
        param = _data(s.param)
        if self.kernel is None:
            from moetrain.runtime.packages import triton_available

            if param.device.type != "cuda" or not triton_available():
                return False
        tensors = [param, s.exp_avg, s.exp_avg_sq] + [t for t in (s.master, s.main_grad) if t is not None]
        return all(t.is_contiguous() for t in tensors)

    def _kernels(self):
        if self._kernel_path is None:
            from moetrain.train.optim_kernels import KernelPath

            self._kernel_path = KernelPath()
        return self._kernel_path

    def _hyper(self):
        from moetrain.train.optim_kernels import Hyper

        c = self.cfg
        return Hyper(c.beta1, c.beta2, c.eps, c.weight_decay)

    def prepare_device_step(self, device: torch.device) -> None:
        """Make what ``step_on_device`` reads that must exist before a CUDA graph captures it: the step counter and
        the kernel's tensor tables (from the gradients as they are now: call it after the micro-batches' capture)."""
        self.device_step_counter(device)
        kernel, _ = self._split(lambda *_: False)
        for groups in kernel.values():
            self._kernels().update_tables(groups)
        covered = self._covered()
        grads = [g for i, g in enumerate(self.grads())
                 if g is not None and covered[i] and self.slots[i].name not in self.norm_excluded]
        if grads:
            self._kernels().norm_tables([g if g.is_contiguous() else g.contiguous() for g in grads])

    def device_step_counter(self, device: torch.device) -> torch.Tensor:
        """The fp32 step counter [] that ``step_on_device`` reads and advances, made from ``step_count`` on first
        use (make it before a capture: made inside one, every replay would start it afresh)."""
        if self._device_step is None:
            self._device_step = torch.full((), float(self.step_count), dtype=torch.float32, device=device)
        return self._device_step

    @torch.no_grad()
    def step_on_device(self, lr: float | torch.Tensor, norm: torch.Tensor, keep: torch.Tensor, clip: float) -> None:
        """``step(lr)`` with no host in the loop: the learning rate is a number or a device scalar (inside a CUDA
        graph it must be the latter, updated between replays), the gradients are
        clipped to global norm ``clip`` (0: off) by the fused kernel's grad_scale, and nothing moves where
        ``keep`` (fp32 []: 1 apply, 0 skip, e.g. a non-finite gradient) is 0: the kernel's found_inf. The
        host-side ``step_count`` is the caller's to advance (``count_step``) once it has read ``keep``.
        Needs every parameter on the kernel or the fused path (``explicit_slots()`` empty). Under a CUDA graph
        capture, call ``prepare_device_step`` before it."""
        if self.explicit_slots():
            raise RuntimeError(f"step_on_device needs the Triton or the fused AdamW path for every parameter; "
                               f"explicit: {self.explicit_slots()[:5]}")
        step_t = self.device_step_counter(norm.device)
        step_t.add_(keep)
        found_inf = 1.0 - keep
        # grads / grad_scale = grads * min(1, clip / (norm + 1e-6)): the eager path's clip
        grad_scale = (norm + 1e-6).div(clip).clamp(min=1.0) if clip > 0 else None
        kernel, fused = self._split(lambda *_: True)
        for (_, _, decay), items in fused.items():
            self._fused_adamw(items, step_t, lr, decay, grad_scale=grad_scale, found_inf=found_inf)
        for device, groups in kernel.items():
            lr_t = lr if isinstance(lr, torch.Tensor) else _device_scalar(lr, device)
            self._kernels().update(groups, step_t, lr_t, self._hyper(), grad_scale=grad_scale, found_inf=found_inf)
        self._copy_masters()  # a skipped step leaves the masters as they were: the copy changes nothing then
        _weights_changed()

    def count_step(self) -> None:
        """Advance the host-side step count after an applied ``step_on_device``."""
        self.step_count += 1

    def _step_explicit(self, s: _Slot, target: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        c = self.cfg
        adamw_reference(target, grad, s.exp_avg, s.exp_avg_sq, lr, self.step_count, c.beta1, c.beta2, c.eps,
                        c.weight_decay if s.decay else 0.0)

    # ---- checkpointing -------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {}
        for s in self.slots:
            entry = {"exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq}
            if s.master is not None:
                entry["master"] = s.master
            state[s.name] = entry
        return {"step": self.step_count, "params": state}

    def load_state_dict(self, state: dict) -> None:
        names = {s.name for s in self.slots}
        saved = set(state["params"])
        if names != saved:
            missing, extra = sorted(names - saved)[:5], sorted(saved - names)[:5]
            raise ValueError(f"optimizer state does not match the model: missing {missing}, unexpected {extra}")
        self.step_count = int(state["step"])
        made = []
        for s in self.slots:
            entry = state["params"][s.name]
            s.exp_avg.copy_(entry["exp_avg"])
            s.exp_avg_sq.copy_(entry["exp_avg_sq"])
            if s.master is not None and "master" in entry:
                s.master.copy_(entry["master"])
            elif s.master is not None:
                made.append(s.name)
            elif "master" in entry:  # saved with master weights, resumed without: keep their precision
                _data(s.param).copy_(entry["master"])
        self.sync_from_masters(made_from_params=made)

    def sync_from_masters(self, made_from_params: list[str] = ()) -> None:
        """After a load: each master weight copied into its parameter, except those named in ``made_from_params``
        (saved without master weights), which are made from the loaded parameter instead."""
        self._device_step = None  # made afresh from step_count
        made = set(made_from_params)
        for s in self.slots:
            if s.master is None:
                continue
            if s.name in made:
                s.master.copy_(_data(s.param))
            else:
                _data(s.param).copy_(s.master)
        _weights_changed()



def adamw_reference(target: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    lr: float, step: int, beta1: float, beta2: float, eps: float, weight_decay: float,
                    grad_scale: float = 1.0) -> None:
    """One AdamW step of one tensor, in place: the explicit path, and the Triton kernel's reference.

    target (fp32/bf16/fp16: an fp32 master or the parameter), grad, exp_avg, exp_avg_sq: one shape, any of those
    dtypes; the math in fp32 (bias corrections in Python floats), each result rounded once into its tensor. The
    definition of torch._fused_adamw_ (its operations ordered differently: equal within fp32 rounding):
    g = grad / grad_scale; w *= 1 - lr * weight_decay; m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2;
    w -= lr / (1 - beta1^step) * m / (sqrt(v / (1 - beta2^step)) + eps)."""
    bias1 = 1.0 - beta1 ** step
    bias2 = 1.0 - beta2 ** step
    g = grad.float() if grad_scale == 1.0 else grad.float() / grad_scale  # never the gradient itself, in place
    m = exp_avg.float()  # the same tensor when already fp32: updated in place
    v = exp_avg_sq.float()
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    w = target.float()
    if weight_decay:
        w.mul_(1.0 - lr * weight_decay)
    denom = (v / bias2).sqrt_().add_(eps)
    w.addcdiv_(m, denom, value=-lr / bias1)
    # Store back whatever is not already the fp32 tensor updated in place.
    if exp_avg.dtype != torch.float32:
        exp_avg.copy_(m)
    if exp_avg_sq.dtype != torch.float32:
        exp_avg_sq.copy_(v)
    if target.dtype != torch.float32:
        target.copy_(w)


def _one_dtype(s: _Slot, target: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether torch's fused AdamW takes the slot: its updated tensor, gradient and moments of one dtype."""
    return target.dtype == grad.dtype == s.exp_avg.dtype == s.exp_avg_sq.dtype


def _device_scalar(value: float, device: torch.device) -> torch.Tensor:
    """fp32 [] on ``device``, filled there (no copy from the host, no sync)."""
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _weights_changed() -> None:
    """The parameters were written (through ``_data``, which moves no version counter): cached FP8 weight copies
    are stale (``ops.grouped_gemm_fp8.WEIGHTS``)."""
    from moetrain.ops.grouped_gemm_fp8 import WEIGHTS

    WEIGHTS.weights_changed()


def _data(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor an update writes: a parameter's data, or a DTensor's local shard (a view of its storage)."""
    if t is None:
        return None
    to_local = getattr(t, "to_local", None)
    return to_local().detach() if to_local is not None else t.data


def attach_main_grad(param: torch.Tensor, grad_dtype: torch.dtype):
    """A zeroed ``grad_dtype`` buffer shaped like ``param`` and the post-accumulate hook that adds each
    gradient into it (and drops ``param.grad``); returns (buffer, hook handle: ``.remove()`` detaches)."""
    main_grad = torch.zeros_like(param, dtype=grad_dtype)
    return main_grad, param.register_post_accumulate_grad_hook(_accumulate_into(main_grad))


def _accumulate_into(main_grad: torch.Tensor):
    # The hook must not reference the parameter (or anything holding it): the parameter's C++
    # side owns the hook, and a cycle through it is invisible to Python's GC -- the whole model
    # and optimizer state would outlive training (seen: 52 GiB kept alive on an H200).
    def hook(param: torch.Tensor) -> None:
        main_grad.add_(param.grad)
        param.grad = None
    return hook
