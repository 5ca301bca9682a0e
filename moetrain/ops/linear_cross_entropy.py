"""Fused linear + cross-entropy: the LM loss from the hidden states and the head's weight, never forming [T, V] logits.

Legend: T tokens, H hidden, V vocabulary rows held here (the whole vocabulary without vocab parallelism), C tokens
per chunk, R ranks of ``vocab_group``. "acc" is fp32, or fp64 for fp64 inputs.

    loss_sum, count = linear_cross_entropy(h [T, H], weight [V, H], labels [T] int64)
    loss_sum: [] acc, the sum over tokens with labels != ignore_index of -log softmax(h @ weight^T)[label]
    count:    [] int64, the number of those tokens (the caller divides: ``linear_cross_entropy_mean``)

h and weight share one dtype (bf16, fp16, fp32 or fp64); weight is the head's, or the embedding's for a tied head.
The definition is the unfused path's (``cross_entropy(F.linear(h, weight), labels)`` in models.transformer): logits
from a GEMM in the inputs' dtype (fp32 accumulation inside it, one rounding to that dtype), log-softmax in acc.

Per chunk of C tokens, in one pass: logits z [C, V] (the GEMM), z in acc, the row max m, p = exp(z - m) in place,
the log-sum-exp, the chunk's loss, then the gradient of the loss w.r.t. z, softmax - onehot (rows of ignored tokens
zero) in place of p, rounded to the inputs' dtype as g (on a GPU all of this after the GEMM is one Triton kernel
over the b-byte z, g written over z: "Fused on a GPU" below), and dh[chunk] = g @ weight [C, H] (a GEMM) and
dW_acc += g^T @ h[chunk] [V, H] (a GEMM into an acc accumulator: bf16 operands with an fp32 C on CUDA, through
``torch.addmm(out_dtype=)``, checked on an H100 against the PyTorch path; on the CPU the operands are upcast, whose
products are exact, so the same numbers up to summation order). After the pass dW_acc is rounded once to weight's
dtype. Three GEMMs over [C, V, H], as the unfused forward + backward.

Autograd: the forward computes loss_sum and keeps dh [T, H] and dW [V, H] (in the inputs' dtype, via
save_for_backward, so saved-tensor hooks see them); the backward multiplies them by the incoming gradient of loss_sum
(a scalar, the product computed in acc and rounded once). Nothing else is kept: not h, not the logits. No gradient
work happens when no backward can follow (``torch.is_grad_enabled()`` false, or neither h nor weight requires grad);
only the gradient asked for is computed (a frozen head: no dW). Trade-off: the gradient is computed in the forward,
so a recomputed forward (activation checkpointing around this op) pays for it twice, and double backward is not
supported. Do not checkpoint the loss: it keeps only dh and dW anyway.

Memory, bytes (b = the inputs' dtype size, 2 for bf16; C = the chunk):
  unfused: forward peak 10TV for bf16 (bf16 logits, their fp32 copy, the fp32 log-probs; 8TV for fp32), kept 4TV
           (the log-probs), backward peak about 10TV + 2VH (two fp32 [T, V] gradients, their bf16 cast, dW)
  fused:   loop peak 4VH (dW_acc) + bTH (dh) + the chunk's transient: on the PyTorch path 4CV (the chunk's acc
           logits) + bCV below fp32 (the GEMM's output, then g), with the kernels bCV (g written over the GEMM's
           output; at 3x the C below fp32, so the same bytes); then 4VH + bVH while dW_acc is rounded;
           kept bTH + bVH; backward peak 2(bTH + bVH)
The kept ratio is 4TV / (bTH + bVH), about 2T/H for bf16 and T << V: at T = 2048, V = 32768, H = 128 (the test),
8.5 MiB against 256 MiB; the forward peak there with C = 256 is 64.5 MiB against 640 MiB. At DeepSeek-V3's T = 4096,
H = 7168, V = 129280 (bf16) the [V, H] terms dominate: forward peak 5.2 GiB (unfused 4.9), kept 1.8 GiB (2.0),
backward peak 3.5 GiB (unfused ~6.6 GiB); there the gain is the [T, V] passes avoided (fp32 copies, concatenations,
separate softmax forward and backward: a time not measured here), and the fused memory grows with T only through dh.
With vocab parallelism every [V, H] term shrinks by R.

Chunk: ``chunk_tokens`` (default ``default_chunk_tokens``): on the PyTorch path one chunk's acc logits are at most
CHUNK_BYTES = 256 MiB, so C >= 512 rows up to V = 131072 (the GEMMs keep the tensor cores busy at M >= 512) while
the chunk's transients (6CV bytes for bf16, 384 MiB) stay well under the unfused path's [T, V] buffers; C is a
multiple of 128 (whole GEMM tiles). The kernels' chunk keeps the same transient bytes: 3x the tokens below fp32
(bCV against 6CV; Qwen3's V = 151936: 1152 tokens against 384), the same at fp32 (``runtime.loss_chunk``).

Vocab parallelism (``vocab_group``, a ProcessGroup): every rank holds weight rows [vocab_start, vocab_start + V) of
the vocabulary and the same h and labels (all tokens). Per chunk, each rank all-gathers its rows' statistics [4, C]
(max, sum of exp(z - max), the label's logit or 0, whether it holds the label) and combines them into the global
log-sum-exp itself: one small collective per chunk, on the device stream, no host sync. Per chunk, not per pass:
the chunk's gradient needs the global log-sum-exp before its logits are dropped; gathering once per pass would need
every chunk's logits kept (the [T, V] we avoid) or recomputed (a fourth GEMM). One all-gather, not two all-reduces
(max, then the sum): each rank combines the R pairs. Every rank computes the same loss_sum. dh: each rank's
g @ weight is a partial sum over its rows; the op all-reduces dh once after the pass (one large message, off the
chunks' critical path), so dh is complete on every rank: the gradient of a Replicate h. dW is each rank's own rows.
All ranks must use the same chunk_tokens (the collectives pair up per chunk): the default is the same where every
rank holds the same number of rows.

Labels: ignore_index rows contribute nothing (all ignored: (0, 0), zero gradients). A label no rank holds (outside
[0, vocab size), other than ignore_index) never indexes out of bounds (the index is clamped and masked) and makes
loss_sum NaN, which needs no host sync. With ``check_labels`` the op also raises ValueError naming the first such
label, at the cost of one host sync; the default checks where that costs no device sync (labels on the CPU).

Fused on a GPU (``kernels.cross_entropy``, where ``kernels_run_here``: CUDA bf16 / fp16 / fp32 inputs with triton):
the per-chunk elementwise work on the PyTorch path is 7 ops over [C, V] (acc copy, max, subtract, exp, sum, scale,
cast; the one-hot is a scatter of C elements), about 44 bytes of memory traffic per logit for bf16 (32 for fp32),
against 2C*V*H flops per GEMM. The kernels read the b-byte logits for the fp32 statistics (max and sum of
exponentials in one online pass, and the label's logit) and then read them again to write the gradient over them:
3b bytes per logit (6 for bf16, 12 for fp32), no acc copy, and the chunk 3x larger below fp32 for the same memory.
Without vocab parallelism one fused launch per chunk does both passes (one program per row; its second pass walks
the row backwards to start on blocks still in L2); with it the statistics kernel (b bytes per logit), the
all-gather, then the gradient kernel (2b). Without a backward only the statistics: b bytes per logit against
PyTorch's ~30. The numbers are the PyTorch path's (its code, ``_chunk_torch``, is the kernels' reference): the loss
from the same fp32 statistics, the gradient exp(z - lse) - onehot rounded once to the inputs' dtype (PyTorch
computes exp(z - m) * exp(m - lse): the same fp32 value to a few ulps, so the 16-bit g agrees to one ulp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrain.ops.custom_ops import kernel_op
from moetrain.runtime import loss_chunk

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp64 stays on the PyTorch path


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: the dtype of the log-softmax, the loss and the dW accumulator."""
    return torch.promote_types(dtype, torch.float32)


_TRITON: list = []  # whether triton imports: a fact of the process, probed once


def kernels_run_here(h: torch.Tensor) -> bool:
    """Whether the chunks' elementwise work runs the Triton kernels (``kernels.cross_entropy``): CUDA inputs of bf16,
    fp16 or fp32 with triton importable. Else the PyTorch path (the CPU, fp64), the kernels' reference; the tests
    force the kernels on CPU tensors under Triton's interpreter by replacing this function."""
    if not (h.is_cuda and h.dtype in KERNEL_DTYPES):
        return False
    if not _TRITON:
        from moetrain.runtime.packages import triton_available

        _TRITON.append(triton_available())
    return _TRITON[0]


def default_chunk_tokens(vocab_rows: int, dtype: torch.dtype = torch.float32, kernels: bool = False) -> int:
    """Tokens per chunk so that one chunk's [C, vocab_rows] buffers take at most what CHUNK_BYTES of acc logits make
    on the PyTorch path (``runtime.loss_chunk``); ``kernels``: the Triton path's chunk (3x for bf16/fp16, whose
    kernels keep no acc copy), as ``kernels_run_here`` decides for the inputs."""
    if kernels and dtype in KERNEL_DTYPES:
        return loss_chunk.chunk_tokens(vocab_rows, 4, dtype.itemsize)
    return loss_chunk.chunk_tokens(vocab_rows, acc_dtype(dtype).itemsize)


def _check_args(h, weight, labels, chunk_tokens) -> None:
    if h.dim() != 2 or weight.dim() != 2 or labels.dim() != 1 or h.shape[1] != weight.shape[1] \
            or labels.shape[0] != h.shape[0]:
        raise ValueError(f"linear_cross_entropy: h {tuple(h.shape)}, weight {tuple(weight.shape)}, labels "
                         f"{tuple(labels.shape)} must be [T, H], [V, H], [T]")
    if h.dtype != weight.dtype or h.dtype not in DTYPES:
        raise ValueError(f"linear_cross_entropy: h and weight must share one of bf16, fp16, fp32, fp64; got {h.dtype}, "
                         f"{weight.dtype}")
    if labels.dtype != torch.int64:
        raise ValueError(f"linear_cross_entropy: labels must be int64, got {labels.dtype}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")


_CUDA_WAYS: dict = {}  # (device, operand dtype) -> how this torch accumulates 16-bit products into fp32 on CUDA


def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, accumulated in acc's dtype (fp32/fp64) from a and b in the inputs' dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        way = _cuda_way(acc, a)
        if way == "addmm":  # cuBLAS: bf16/fp16 operands, the fp32 C read and written in place
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
        elif way == "mm":  # an fp32 product, then added: one more [V, H] fp32 pass
            acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
        else:
            acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    else:  # upcast operands: their products are exact in fp32, so the same numbers up to summation order
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _cuda_way(acc: torch.Tensor, a: torch.Tensor) -> str:
    """"addmm" where this torch's addmm takes out_dtype with an fp32 out, else "mm" where mm takes out_dtype, else
    "upcast": probed once per device and dtype on 2 x 2 operands (the CUDA kernels of these overloads differ
    between torch versions)."""
    key = (acc.device, a.dtype)
    if key not in _CUDA_WAYS:
        x = torch.ones(2, 2, device=acc.device, dtype=a.dtype)
        c = torch.zeros(2, 2, device=acc.device, dtype=acc.dtype)
        for way, probe in (("addmm", lambda: torch.addmm(c, x, x, out_dtype=c.dtype, out=c)),
                           ("mm", lambda: torch.mm(x, x, out_dtype=c.dtype))):
            try:
                probe()
                _CUDA_WAYS[key] = way
                break
            except (RuntimeError, TypeError):
                continue
        else:
            _CUDA_WAYS[key] = "upcast"
    return _CUDA_WAYS[key]


def _resolve_group(group_name: str):
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _global_stats(group, m, s, zt, holds):
    """Combine the R ranks' row statistics ([C] each, acc) into the global log-sum-exp, the label's logit and how
    many ranks hold the label (one all-gather of [4, C] per rank)."""
    import torch.distributed as dist

    local = torch.stack([m, s, zt, holds.to(m.dtype)])
    R = dist.get_world_size(group)
    everyone = local.new_empty(R * 4, local.shape[1])
    # all_gather_single from torch 2.13 on, which deprecates all_gather_into_tensor (the same collective)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(everyone, local, group=group)
    return combine_stats(everyone.view(R, 4, -1))


def combine_stats(everyone: torch.Tensor):
    """(lse, zt, held_by) [C] each from the R ranks' rows [R, 4, C] (max, sum of exp(z - max), label logit,
    holds)."""
    ms, ss = everyone[:, 0], everyone[:, 1]
    top = ms.amax(0)
    lse = top + torch.log((ss * torch.exp(ms - top)).sum(0))
    return lse, everyone[:, 2].sum(0), everyone[:, 3].sum(0)


def _chunk(h_c, weight, labels_c, ignore_index: int, vocab_start: int, group, grad: bool):
    """One chunk of C tokens: (loss [] acc, bad [C] bool: a label no rank holds, g [C, V] in h's dtype: the loss's
    gradient w.r.t. the chunk's logits, or None without ``grad``). The Triton kernels where ``kernels_run_here``,
    else PyTorch (the reference: the same numbers up to fp32 rounding order)."""
    valid = labels_c != ignore_index
    local = labels_c - vocab_start
    holds = valid & (local >= 0) & (local < weight.shape[0])  # this rank's rows hold the label
    # the logits z [C, V] in h's dtype, fp32 accumulation inside the GEMM; not bound here, so that the PyTorch path
    # holds the only reference and frees a 16-bit z once it has its acc copy
    if kernels_run_here(h_c):
        return _chunk_kernels(torch.mm(h_c, weight.t()), labels_c, valid, holds, ignore_index, vocab_start, group,
                              grad)
    return _chunk_torch(torch.mm(h_c, weight.t()), local, valid, holds, group, grad)


def _chunk_torch(z, local, valid, holds, group, grad: bool):
    """``_chunk`` after the GEMM in PyTorch: the kernels' reference (module docstring). local: labels - vocab_start."""
    dt = acc_dtype(z.dtype)
    out_dtype = z.dtype
    idx = torch.where(holds, local, 0).unsqueeze(1)  # always in bounds: other rows are masked by holds
    zt = torch.where(holds, z.gather(1, idx).squeeze(1).to(dt), 0)  # the label's logit, 0 where not held here
    p = z.to(dt)  # is z itself for acc inputs
    del z  # not read again: a bf16 z is freed here
    m = p.amax(1)
    p.sub_(m[:, None]).exp_()
    s = p.sum(1)
    if group is None:
        lse, hits = m + torch.log(s), holds
    else:
        lse, zt, held_by = _global_stats(group, m, s, zt, holds)
        hits = held_by > 0
    loss = torch.where(valid, lse - zt, 0).sum()
    bad = valid & ~hits
    if not grad:
        return loss, bad, None
    # softmax = exp(z - lse) = p * exp(m - lse) (m this rank's max), zero on ignored rows; minus the one-hot here
    p.mul_(torch.where(valid, torch.exp(m - lse), 0)[:, None])
    p.scatter_add_(1, idx, -holds.to(dt)[:, None])
    return loss, bad, p.to(out_dtype)


def _chunk_kernels(z, labels_c, valid, holds, ignore_index: int, vocab_start: int, group, grad: bool):
    """``_chunk`` after the GEMM, through the kernels: the gradient is written over z (no acc copy). The whole
    vocabulary here: one fused launch (or the statistics alone without ``grad``); vocab-parallel: the statistics,
    the ranks' combined (``_global_stats``), then the gradient."""
    if group is None and grad:
        lse, zt = cross_entropy_fused(z, labels_c, ignore_index, vocab_start)
        hits = holds
    else:
        m, s, zt = cross_entropy_stats(z, labels_c, ignore_index, vocab_start)
        if group is None:
            lse, hits = m + torch.log(s), holds
        else:
            lse, zt, held_by = _global_stats(group, m, s, zt, holds)
            hits = held_by > 0
        if grad:
            cross_entropy_grad(z, labels_c, lse, ignore_index, vocab_start)
    loss = torch.where(valid, lse - zt, 0).sum()
    return loss, valid & ~hits, z if grad else None


# The kernels (kernels.cross_entropy, imported on first use: it imports triton) as custom ops. z [C, V] bf16 / fp16 /
# fp32, labels [C] int64; every statistic fp32 [C].

def _kernels():
    from moetrain.kernels import cross_entropy

    return cross_entropy


def _stats_fake(z, labels, ignore_index, vocab_start):
    return tuple(z.new_empty(z.shape[0], dtype=torch.float32) for _ in range(3))


@kernel_op("cross_entropy_stats", fake=_stats_fake)
def cross_entropy_stats(z: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        vocab_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, s, zt): each row's max, sum of exp(z - m) and label logit (0 where not held here); z read once."""
    return _kernels().row_stats(z, labels, ignore_index, vocab_start)


@kernel_op("cross_entropy_grad", fake=lambda z, labels, lse, ignore_index, vocab_start: None, mutates_args=("z",))
def cross_entropy_grad(z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                       vocab_start: int) -> None:
    """Writes softmax - onehot (zero rows where ignored) over z, from each row's log-sum-exp lse fp32 [C]."""
    _kernels().row_grad(z, labels, lse, ignore_index, vocab_start)


def _fused_fake(z, labels, ignore_index, vocab_start):
    return z.new_empty(z.shape[0], dtype=torch.float32), z.new_empty(z.shape[0], dtype=torch.float32)


# tuples, not lists: functionalization refuses a list output from an op that mutates an input
@kernel_op("cross_entropy_fused", fake=_fused_fake, mutates_args=("z",))
def cross_entropy_fused(z: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, zt), and the gradient written over z: the statistics and the gradient in one launch."""
    return _kernels().row_fused(z, labels, ignore_index, vocab_start)


def _raise_on_bad_labels(labels, bad, vocab_rows: int, vocab_start: int, ignore_index: int, group) -> None:
    """ValueError naming the first label no rank holds (one host sync)."""
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0, 0])
    where = ("no rank of vocab_group holds it" if group is not None
             else f"the vocabulary is [{vocab_start}, {vocab_start + vocab_rows})")
    raise ValueError(f"linear_cross_entropy: label {int(labels[i])} of token {i} is neither a vocabulary id nor "
                     f"ignore_index ({ignore_index}): {where}")


def _pass_fake(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, ignore_index: int,
               vocab_start: int, group_name: str, need_dh: bool, need_dw: bool,
               check_labels: bool) -> list[torch.Tensor]:
    out = [h.new_empty((), dtype=acc_dtype(h.dtype)), labels.new_empty((), dtype=torch.int64)]
    if need_dh:
        out.append(h.new_empty(h.shape))
    if need_dw:
        out.append(weight.new_empty(weight.shape))
    return out


@kernel_op("linear_cross_entropy", fake=_pass_fake)
def linear_cross_entropy_pass(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                              ignore_index: int, vocab_start: int, group_name: str, need_dh: bool, need_dw: bool,
                              check_labels: bool) -> list[torch.Tensor]:
    """The chunked pass (module docstring): [loss_sum [] acc, count [] int64] + [dh [T, H]] if need_dh + [dW [V, H]]
    if need_dw, the gradients those of loss_sum, in the inputs' dtype. group_name: the vocab group's name, "" for none
    (custom ops take no ProcessGroup)."""
    group = _resolve_group(group_name)
    T, dt = h.shape[0], acc_dtype(h.dtype)
    loss = h.new_zeros((), dtype=dt)
    bad = torch.zeros(T, dtype=torch.bool, device=h.device)
    dh = h.new_empty(h.shape) if need_dh else None
    dw_acc = weight.new_zeros(weight.shape, dtype=dt) if need_dw else None
    for start in range(0, T, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, T))
        chunk_loss, chunk_bad, g = _chunk(h[rows], weight, labels[rows], ignore_index, vocab_start, group,
                                          need_dh or need_dw)
        loss += chunk_loss
        bad[rows] = chunk_bad
        if need_dh:
            torch.mm(g, weight, out=dh[rows])
        if need_dw:
            _addmm_acc(dw_acc, g.t(), h[rows])
        del g  # freed before the next chunk's logits: one chunk's [C, V] buffers at a time
    if need_dh and group is not None:
        import torch.distributed as dist

        dist.all_reduce(dh, group=group)  # each rank's rows gave a partial sum: dh is whole on every rank
    loss = torch.where(bad.any(), torch.nan, loss)  # a label no rank holds poisons the loss, without a host sync
    if check_labels:
        _raise_on_bad_labels(labels, bad, weight.shape[0], vocab_start, ignore_index, group)
    out = [loss, (labels != ignore_index).sum()]
    if need_dh:
        out.append(dh)
    if need_dw:
        out.append(dw_acc.to(weight.dtype))  # one rounding; the accumulator itself for fp32/fp64 weights
    return out


def _scaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad * scale in grad's dtype, the product computed in scale's acc dtype and rounded once: scale is a 1-element
    tensor, not 0-dim, so type promotion computes in acc (a 0-dim scale would be rounded to bf16 first on CUDA)."""
    return torch.mul(grad, scale, out=torch.empty_like(grad))


class _LinearCrossEntropy(torch.autograd.Function):
    """loss_sum, count from the pass; keeps the pass's dh and dW, scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk_tokens, ignore_index, vocab_start, group_name, need_dh, need_dw,
                check_labels):
        out = linear_cross_entropy_pass(h, weight, labels, chunk_tokens, ignore_index, vocab_start, group_name,
                                        need_dh, need_dw, check_labels)
        ctx.need = (need_dh, need_dw)
        ctx.save_for_backward(*out[2:])
        ctx.mark_non_differentiable(out[1])
        return out[0], out[1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_count):
        kept = iter(ctx.saved_tensors)
        scale = grad_loss.reshape(1)
        dh = _scaled(next(kept), scale) if ctx.need[0] else None
        dw = _scaled(next(kept), scale) if ctx.need[1] else None
        return dh, dw, None, None, None, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         chunk_tokens: int | None = None, ignore_index: int = -100, vocab_group=None,
                         vocab_start: int = 0, check_labels: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum [] acc, count [] int64) of the cross-entropy of softmax(h [T, H] @ weight [V, H]^T) against labels
    [T] int64 (module docstring). chunk_tokens: default ``default_chunk_tokens(V)``. vocab_group, vocab_start: this
    rank holds vocabulary rows [vocab_start, vocab_start + V) of the group's (vocab parallelism). check_labels: raise
    ValueError on a label no rank holds (one host sync); None checks labels on the CPU only."""
    _check_args(h, weight, labels, chunk_tokens)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], h.dtype, kernels_run_here(h))
    group_name = "" if vocab_group is None else vocab_group.group_name
    check = labels.device.type == "cpu" if check_labels is None else bool(check_labels)
    grad = torch.is_grad_enabled()
    need_dh, need_dw = grad and h.requires_grad, grad and weight.requires_grad
    args = (h, weight, labels, chunk, ignore_index, vocab_start, group_name, need_dh, need_dw, check)
    if not (need_dh or need_dw):  # no backward can follow: no gradient work
        loss, count = linear_cross_entropy_pass(*args)
        return loss, count
    return _LinearCrossEntropy.apply(*args)


def linear_cross_entropy_mean(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              **kwargs) -> torch.Tensor:
    """[] acc: loss_sum / max(count, 1), the mean over labels != ignore_index (0 when all are ignored), as
    models.transformer.cross_entropy; keyword arguments as ``linear_cross_entropy``."""
    loss_sum, count = linear_cross_entropy(h, weight, labels, **kwargs)
    return loss_sum / count.clamp(min=1)


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain definition on one device: logits [T, V] in acc from the upcast inputs, F.cross_entropy summed;
    (loss_sum [] acc, count [] int64), differentiable by autograd."""
    dt = acc_dtype(h.dtype)
    logits = h.to(dt) @ weight.to(dt).t()
    loss_sum = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return loss_sum, (labels != ignore_index).sum()
