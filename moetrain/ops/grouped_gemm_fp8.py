"""FP8 grouped GEMMs: the references (fp32 math on the quantized values) that the FP8 kernels are tested against.

Shapes and dtypes (legend in ``fp8_quant``):
    x    [M, K]     float (rows sorted by group)      dy   [M, N]  float (the output's gradient)
    w    [G, N, K]  float                             offs [G]     int32 cumulative row ends (as grouped_gemm)
Outputs are float32: forward y [M, N], data gradient dx [M, K], weight gradient dw [G, N, K].

Each operand is quantized the way the recipe's kernels quantize it (``fp8_quant``):
    forward  y_g  = x_g  @ w_g^T    x along K (activation tiles), w in weight tiles
    dgrad    dx_g = dy_g @ w_g      dy along N, w^T along N (the weight's own blocks, transposed, for blockwise)
    wgrad    dw_g = dy_g^T @ x_g    dy^T and x^T along M: rowwise over each group's rows; tensorwise over the
                                    whole tensor; blockwise and mxfp8 in tiles of consecutive rows of the whole
                                    tensor (a tile may meet two groups: it is one scale for both; with groups
                                    padded to the tile, ``permute(align=128)``, none does)
Rows past offs[-1] belong to no group: their y and dx are 0.
"""

from __future__ import annotations

import torch

from moetrain.config.schema import FP8_FUSED as SCALED
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
    dw = torch.zeros(G, dy.shape[1], x.shape[1], dtype=torch.float32, device=dy.device)
    if recipe == "rowwise":  # each group's columns scaled over its own rows
        for g, (s, e) in enumerate(_bounds(offs)):
            if e > s:
                dw[g] = round_trip(dy[s:e].T, recipe) @ round_trip(x[s:e].T, recipe).T
        return dw
    a = round_trip(dy.T, recipe, "activation")  # [N, M] along M
    b = round_trip(x.T, recipe, "activation")  # [K, M]
    for g, (s, e) in enumerate(_bounds(offs)):
        dw[g] = a[:, s:e] @ b[:, s:e].T
    return dw


# ---- the op --------------------------------------------------------------------------------------------------

class WeightCache:
    """Each weight's FP8 copies under a recipe (blockwise: blocks, transposed blocks, scales; rowwise and
    tensorwise: ``grouped_gemm_fp8_scaled.quantize_weight``; mxfp8: ``grouped_gemm_fp8_mx.quantize_weight``), made
    again only when the weight changed: after ``weights_changed`` (the optimizer's update or a load) or an in-place
    change of the tensor itself (its version counter), so the micro-batches of one step quantize it once. Kept on the
    weight tensor itself (an attribute per recipe): they live and die with it. Inside a CUDA graph capture
    (train.cuda_graph) nothing is cached: the graph quantizes the weight on each replay."""

    ATTR = "_moetrain_fp8_"

    def __init__(self):
        self.epoch = 0  # moved by weights_changed

    def get(self, w: torch.Tensor, recipe: str = "blockwise") -> tuple[torch.Tensor, ...]:
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            # a CUDA graph replays without this host check: the quantization is captured and reruns on every
            # replay from the weight's current values (one per micro-batch), never a copy made at capture time
            return self._quantize(w.detach(), recipe)
        attr = self.ATTR + recipe
        key = (w._version, self.epoch)
        entry = getattr(w, attr, None)
        if entry is None or entry[0] != key:
            entry = (key, self._quantize(w.detach(), recipe))
            setattr(w, attr, entry)
        return entry[1]

    def weights_changed(self) -> None:
        """Every cached copy is stale from now on: the optimizer calls this after each update and load. (Its
        writes go through ``.data`` or a DTensor's local shard, which move no version counter of the tensor the
        forward passes here; under FSDP that tensor is the all-gathered parameter, refilled each forward.)"""
        self.epoch += 1

    @staticmethod
    def _quantize(w: torch.Tensor, recipe: str) -> tuple[torch.Tensor, ...]:
        if recipe == "blockwise":
            from moetrain.kernels.fp8_quantize import quantize_weight_blocks

            return quantize_weight_blocks(w)
        if recipe == "mxfp8":
            from moetrain.ops.grouped_gemm_fp8_mx import quantize_weight as quantize_mx_weight

            return quantize_mx_weight(w)
        from moetrain.ops.grouped_gemm_fp8_scaled import quantize_weight

        return quantize_weight(w, recipe)


WEIGHTS = WeightCache()


class _BlockwiseGroupedGemm(torch.autograd.Function):
    """y = x_g @ w_g^T in blockwise FP8 (Triton kernels); backward: dx through the transposed weight blocks, dw from
    the column-quantized copies of x (kept from the forward, FP8: half of x's bf16 bytes) and dy."""

    @staticmethod
    def forward(ctx, x, w, offs):
        from moetrain.kernels.fp8_blockwise import grouped_gemm_blockwise
        from moetrain.kernels.fp8_quantize import quantize_rows_and_cols

        q, s, qt, st = quantize_rows_and_cols(x)
        wq, wqt, ws = WEIGHTS.get(w)
        ctx.save_for_backward(qt, st, offs)
        ctx.w = w
        ctx.x_dtype = x.dtype
        return grouped_gemm_blockwise(q, s, wq, ws, offs, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, dy):
        from moetrain.kernels.fp8_blockwise import grouped_gemm_blockwise, grouped_wgrad_blockwise
        from moetrain.kernels.fp8_quantize import quantize_rows_and_cols

        qt, st, offs = ctx.saved_tensors
        w = ctx.w
        g, sg, gt, sgt = quantize_rows_and_cols(dy)
        _, wqt, ws = WEIGHTS.get(w)
        dx = grouped_gemm_blockwise(g, sg, wqt, ws.transpose(1, 2).contiguous(), offs, out_dtype=ctx.x_dtype)
        dw = grouped_wgrad_blockwise(gt, sgt, qt, st, offs, out_dtype=w.dtype)
        return dx, dw, None


class _ReferenceGroupedGemm(torch.autograd.Function):
    """The references with autograd (any recipe, any device): fp32 math on the quantized operands, forward and
    backward alike, results in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, x, w, offs, recipe):
        ctx.save_for_backward(x, w, offs)
        ctx.recipe = recipe
        return grouped_gemm_fp8_reference(x, w, offs, recipe).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dx = grouped_dgrad_fp8_reference(dy, w, offs, ctx.recipe).to(x.dtype)
        dw = grouped_wgrad_fp8_reference(dy, x, offs, ctx.recipe).to(w.dtype)
        return dx, dw, None, None


def kernels_run_here(x: torch.Tensor) -> bool:
    """Whether the FP8 kernels run on x: CUDA tensors, or CPU tensors in Triton's interpreter."""
    if x.device.type == "cuda":
        return True
    from moetrain.runtime.packages import triton_available

    if x.device.type != "cpu" or not triton_available():
        return False
    from moetrain.kernels.grouped_gemm_configs import interpreting

    return interpreting()


def grouped_gemm_fp8(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, recipe: str = "blockwise") -> torch.Tensor:
    """y [M, N] = x_g @ w_g^T for each group g in FP8 ``recipe`` (shapes in the module doc; y in x's dtype), with
    autograd. Blockwise and mxfp8 run our Triton kernels (mxfp8: tl.dot_scaled, Blackwell's block-scaled tensor
    cores, Triton's emulation on Hopper), rowwise and tensorwise our quantizers and torch._scaled_grouped_mm (CUTLASS),
    on CUDA and on CPU tensors in Triton's interpreter (the GEMM emulated there); elsewhere the references compute
    the same function in fp32."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or offs.shape != (w.shape[0],):
        raise ValueError(f"grouped_gemm_fp8: x {tuple(x.shape)}, w {tuple(w.shape)}, offs {tuple(offs.shape)} do "
                         "not match ([M, K], [G, N, K], [G])")
    offs = offs.to(torch.int32)
    if recipe == "blockwise" and kernels_run_here(x):
        return _BlockwiseGroupedGemm.apply(x, w, offs)
    if recipe in SCALED and kernels_run_here(x):
        from moetrain.ops.grouped_gemm_fp8_scaled import grouped_gemm_fp8_scaled

        return grouped_gemm_fp8_scaled(x, w, offs, recipe)
    if recipe == "mxfp8" and kernels_run_here(x):
        from moetrain.ops.grouped_gemm_fp8_mx import grouped_gemm_fp8_mx

        return grouped_gemm_fp8_mx(x, w, offs)
    if x.device.type == "cuda":
        raise NotImplementedError(f"grouped_gemm_fp8: recipe {recipe!r} has no GPU kernels (blockwise, rowwise, "
                                  "tensorwise and mxfp8 have)")
    return _ReferenceGroupedGemm.apply(x, w, offs, recipe)
