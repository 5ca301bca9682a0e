"""The expert path of an MoE layer: permute -> FC1 -> SwiGLU -> FC2 -> weighted combine.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M = T*K routed rows.

Backends: "triton" is the fused path (FC1 reads token rows through an index inside the GEMM, so no
permuted copy of x exists; see moe_fused.py); "torch" and "loop" permute x first; "auto" measures
torch against triton per shape on CUDA (autoselect.py) and is "loop" elsewhere.

Sync-free: token counts and offsets stay on the device; no host reads depend on routing
(the "loop" grouped GEMM backend is the exception: it is the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrain.ops import autoselect
from moetrain.ops.grouped_gemm import _ALIASES, grouped_gemm, resolve_backend

# GPT-OSS's clamped SwiGLU constants.
CLAMPED_ALPHA = 1.702
CLAMPED_LIMIT = 7.0


def swiglu(h: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """h [M, 2I] (columns 0..I-1 gate, I..2I-1 up) -> [M, I], dtype of h.

    swiglu: silu(gate) * up.
    swiglu_clamped (GPT-OSS): gate clamped above at 7, up clamped to [-7, 7],
    gate * sigmoid(1.702 * gate) * (up + 1).
    """
    gate, up = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return F.silu(gate) * up
    if activation == "swiglu_clamped":
        gate = gate.clamp(max=CLAMPED_LIMIT)
        up = up.clamp(min=-CLAMPED_LIMIT, max=CLAMPED_LIMIT)
        return gate * torch.sigmoid(CLAMPED_ALPHA * gate) * (up + 1)
    raise ValueError(f"unknown expert activation {activation!r}; valid: swiglu, swiglu_clamped")


def permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int):
    """Group the routed copies of each token by expert.

    x [T, H]; topk_idx [T, K] int64 with -1 marking a dropped assignment.
    Returns (x_perm [M, H] rows sorted by expert, offs [E] int32 cumulative group ends,
             row_map [M] int64: x_perm row r is the copy for flat assignment row_map[r] = t*K + k).
    Dropped assignments are grouped with the last expert: every row then holds a finite
    expert output, which the combine multiplies by zero. That costs compute only when tokens
    are actually dropped, and keeps the combine free of masks and host syncs.
    """
    offs, row_map = sort_rows(topk_idx, num_experts)
    x_perm = x.index_select(0, row_map // topk_idx.shape[1])
    return x_perm, offs, row_map


def sort_rows(topk_idx: torch.Tensor, num_experts: int):
    """The routing half of ``permute``: (offs [E] int32, row_map [M] int64), no copy of x."""
    key = _grouping_key(topk_idx.reshape(-1), num_experts)
    row_map = torch.argsort(key, stable=True)
    # scatter_add rather than bincount: bincount sizes its output from the data (a device sync).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts, dim=0).to(torch.int32)
    return offs, row_map


def unpermute(y_perm: torch.Tensor, row_map: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor):
    """Combine: out[t] = sum_k topk_weight[t, k] * y[t*K + k], dropped assignments (-1) excluded.

    y_perm [M, H] in permuted order; row_map [M] from ``permute``; topk_idx/topk_weight [T, K].
    Returns [T, H] in the dtype of y_perm. No atomics: the inverse permutation is a gather and
    the weighted sum over K is a batched [1, K] x [K, H] product (fp32 accumulation inside the
    GEMM; the weights are rounded to y's dtype, as a bf16 layer would).
    """
    T, K = topk_idx.shape
    inverse = torch.empty_like(row_map)
    inverse[row_map] = torch.arange(row_map.numel(), device=row_map.device)
    y = y_perm.index_select(0, inverse).view(T, K, -1)
    weight = torch.where(topk_idx < 0, torch.zeros_like(topk_weight), topk_weight).to(y.dtype)
    return torch.bmm(weight.unsqueeze(1), y).squeeze(1)


def moe_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "swiglu",
    backend: str = "auto",
) -> torch.Tensor:
    """sum_k topk_weight[t, k] * FFN_{topk_idx[t, k]}(x[t]) for every token t.

    x [T, H]; topk_idx [T, K] int64 (-1 = dropped); topk_weight [T, K] fp32;
    w1 [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up); w2 [E, H, I]; b1 [E, 2I]; b2 [E, H].
    FFN_e(x) = w2[e] @ act(w1[e] @ x + b1[e]) + b2[e]. Returns [T, H] in x.dtype.

    backend "triton" runs the fused path: FC1 gathers the token rows inside the GEMM (no permuted
    copy of x; see ``moe_fused``). "auto" on CUDA measures the GPU-validated backends for this shape
    once (``autoselect.GPU_VALIDATED``, cached on disk; today torch only, so nothing is timed);
    "loop"/"reference" is the plain per-expert reference.
    """
    E = w1.shape[0]
    if topk_idx.shape != topk_weight.shape or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts: topk_idx {tuple(topk_idx.shape)} / topk_weight {tuple(topk_weight.shape)} "
            f"must both be [T, K] with T = {x.shape[0]}")
    T, K = topk_idx.shape
    if _ALIASES.get(backend, backend) == "auto" and autoselect.measures(x.device):
        def run(name: str) -> None:  # auto's measurement: forward + backward on detached leaves
            with autoselect.isolated():
                leaves = [t.detach().requires_grad_() if t is not None else None
                          for t in (x, topk_weight, w1, w2, b1, b2)]
                y = moe_experts(leaves[0], topk_idx, leaves[1], leaves[2], leaves[3], b1=leaves[4], b2=leaves[5],
                                activation=activation, backend=name)
                y.backward(torch.ones_like(y))
        backend = autoselect.choose("moe_experts", x, w1.shape[1], w1.shape[2], T * K, E, run)
    backend = resolve_backend(backend, x.device)
    offs, row_map = sort_rows(topk_idx, E)
    if backend == "triton":
        from moetrain.ops.moe_fused import fc1_gathered

        h = fc1_gathered(x, w1, offs, row_map, K)
    else:
        h = grouped_gemm(x.index_select(0, row_map // K), w1, offs, backend)
    if b1 is not None or b2 is not None:
        expert_of_row = _expert_of_row(topk_idx, row_map, E)
    if b1 is not None:
        h = h + b1.index_select(0, expert_of_row)
    a = swiglu(h, activation)
    y = grouped_gemm(a, w2, offs, backend)
    if b2 is not None:
        y = y + b2.index_select(0, expert_of_row)
    return unpermute(y, row_map, topk_idx, topk_weight)


def _grouping_key(flat_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The group of each assignment: its expert, or the last expert for a dropped one (-1)."""
    return torch.where(flat_idx < 0, torch.full_like(flat_idx, num_experts - 1), flat_idx)


def _expert_of_row(topk_idx: torch.Tensor, row_map: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert id of each permuted row; dropped rows sit with the last expert (see ``permute``)."""
    return _grouping_key(topk_idx.reshape(-1).index_select(0, row_map), num_experts)
