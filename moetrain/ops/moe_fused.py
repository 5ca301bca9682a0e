"""FC1 of the fused expert path (triton backend): token rows gathered inside the GEMM.

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, M = T*K routed rows.

    h [M, 2I] = x[token_of_row[r]] @ w1[e(r)]^T     rows r sorted by expert (``permute``'s order)

Forward: the Triton grouped GEMM reads the A rows of x [T, H] through token_of_row = row_map // K,
so the permuted copy x_perm [M, H] is never materialized, and autograd saves x (the layer input,
alive anyway) and the routing instead of x_perm.
Backward:
    dx_perm [M, H] = dgrad(dh, w1)                          (grouped GEMM)
    dx[t]          = sum_k dx_perm[inverse[t*K + k]]        (each token owns exactly K rows: a gather
                                                            and a sum over K; deterministic, no atomics)
    dw1            = wgrad(dh, x_perm)                      (x_perm gathered again, transiently: the
                                                            wgrad kernel has no row gather yet)
Dropped assignments (-1) sit with the last expert (see ``permute``); the combine gives their rows
zero gradient, so they add nothing to dx or dw1.
"""

from __future__ import annotations

import torch


class GatherFC1(torch.autograd.Function):
    """h = grouped_gemm(x[row_map // K], w1, offs) without materializing x[row_map // K]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, row_map: torch.Tensor, topk: int):
        from moetrain.kernels import grouped_gemm as kernels  # imports triton: only on this path

        offs = offs.to(torch.int32)
        token_of_row = (row_map // topk).to(torch.int32)
        ctx.save_for_backward(x, w1, offs, row_map, token_of_row)
        ctx.topk = topk
        return kernels.grouped_gemm_fwd(x, w1, offs, gather_rows=token_of_row)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh: torch.Tensor):
        from moetrain.kernels import grouped_gemm as kernels

        x, w1, offs, row_map, token_of_row = ctx.saved_tensors
        dh = dh.to(x.dtype).contiguous()
        dx = dw1 = None
        if ctx.needs_input_grad[0]:
            dx_perm = kernels.grouped_gemm_dgrad(dh, w1, offs)
            dx = scatter_rows_to_tokens(dx_perm, row_map, x.shape[0], ctx.topk)
        if ctx.needs_input_grad[1]:
            x_perm = x.index_select(0, token_of_row)
            dw1 = kernels.grouped_gemm_wgrad(dh, x_perm, offs)
        return dx, dw1, None, None, None


def inverse_permutation(row_map: torch.Tensor) -> torch.Tensor:
    """inverse[a] = the permuted row that holds flat assignment a (row_map[inverse[a]] = a)."""
    inverse = torch.empty_like(row_map)
    inverse[row_map] = torch.arange(row_map.numel(), device=row_map.device)
    return inverse


def scatter_rows_to_tokens(rows: torch.Tensor, row_map: torch.Tensor, tokens: int, topk: int) -> torch.Tensor:
    """out[t] = sum_k rows[inverse[t*K + k]]: rows [M, H] in permuted order -> [T, H], same dtype.

    A gather then a sum over the K rows of each token (torch accumulates 16-bit sums in fp32 and
    rounds once): deterministic, sync-free, no atomics."""
    gathered = rows.index_select(0, inverse_permutation(row_map)).view(tokens, topk, rows.shape[1])
    return gathered.sum(dim=1)


def fc1_gathered(x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, row_map: torch.Tensor, topk: int) -> torch.Tensor:
    """x [T, H], w1 [E, 2I, H], offs [E] int32, row_map [M] from ``permute`` -> h [M, 2I] in x.dtype."""
    return GatherFC1.apply(x, w1, offs, row_map, topk)
