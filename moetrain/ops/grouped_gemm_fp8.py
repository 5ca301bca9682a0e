"""FP8 grouped GEMMs: the references (fp32 math on the quantized values) that the FP8 kernels are tested against.

Shapes and dtypes (legend in ``fp8_quant``):
    x    [M, K]     float (rows sorted by group)      dy   [M, N]  float (the output's gradient)
    w    [G, N, K]  float                             offs [G]     int32 cumulative row ends (as grouped_gemm)
Outputs are float32: forward y [M, N], data gradient dx [M, K], weight gradient dw [G, N, K].

Each operand is quantized the way the recipe's kernels quantize it (``fp8_quant``):
    forward  y_g  = x_g  @ w_g^T    x along K (activation tiles), w in weight tiles
    dgrad    dx_g = dy_g @ w_g      dy along N, w^T along N (the weight's own blocks, transposed, for blockwise)
    wgrad    dw_g = dy_g^T @ x_g    dy^T and x^T along M, in the recipe's tiles of consecutive rows of the whole
                                    tensor (a tile may meet two groups: it is one scale for both; with groups
                                    padded to the tile, ``permute(align=128)``, none does)
Rows past offs[-1] belong to no group: their y and dx are 0.
"""

from __future__ import annotations

import torch

from moetrain.ops.fp8_quant import round_trip


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()  # a reference: reading offs on the host is fine here
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def grouped_gemm_fp8_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    xq, wq = round_trip(x, recipe, "activation"), round_trip(w, recipe, "weight")
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        y[s:e] = xq[s:e] @ wq[g].T
    return y


def grouped_dgrad_fp8_reference(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    dyq = round_trip(dy, recipe, "activation")
    wtq = round_trip(w.transpose(1, 2), recipe, "weight")  # [G, K, N], scaled along N
    dx = torch.zeros(dy.shape[0], w.shape[2], dtype=torch.float32, device=dy.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        dx[s:e] = dyq[s:e] @ wtq[g].T
    return dx


def grouped_wgrad_fp8_reference(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, recipe: str) -> torch.Tensor:
    G = offs.shape[0]
    a = round_trip(dy.T, recipe, "activation")  # [N, M] along M
    b = round_trip(x.T, recipe, "activation")  # [K, M]
    dw = torch.zeros(G, dy.shape[1], x.shape[1], dtype=torch.float32, device=dy.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        dw[g] = a[:, s:e] @ b[:, s:e].T
    return dw
