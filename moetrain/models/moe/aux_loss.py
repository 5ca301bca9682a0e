"""Aux losses through autograd: a layer's balancing losses reach the backward without travelling beside its output.

``attach_aux_loss(y, aux, scale)`` returns y unchanged (a view); in backward it passes y's gradient through and
gives ``aux`` the gradient ``scale``, as if ``scale * aux`` had been added to the final loss. So every layer
returns one tensor (a pipeline stage is tensor-in, tensor-out) and the losses need no sum across layers for their
gradient. ``scale`` must be the factor the final loss is multiplied by before ``backward`` (1 / micro-batches with
gradient accumulation): ``MoETransformer.set_aux_grad_scale`` sets it on every MoE layer.

The aux values for logging are kept detached on the layer (``MoELayer.aux_value``), not returned.
"""

from __future__ import annotations

import torch


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        daux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=dy.device)
        return dy, daux, None


def attach_aux_loss(y: torch.Tensor, aux: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """y (any shape) unchanged; backward adds d(scale * aux) to aux's graph. aux: a 0-dim fp32 loss with grad."""
    return _AttachAuxLoss.apply(y, aux, scale)
