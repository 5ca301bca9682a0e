"""Single-device model definitions. ``build_model(cfg)`` builds the ``MoETransformer``.

torch is imported lazily so that importing this package (e.g. for ``models.accounting``) does
not need it.
"""


def build_model(cfg, device=None):
    """MoETransformer(cfg), built on ``device`` (e.g. "meta" to allocate nothing; then
    ``model.to_empty(device=...)`` and ``model.init_weights()``)."""
    import torch

    from moetrain.models.transformer import MoETransformer

    if device is None:
        return MoETransformer(cfg)
    with torch.device(device):
        return MoETransformer(cfg)


__all__ = ["build_model"]
