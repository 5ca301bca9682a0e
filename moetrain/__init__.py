"""moetrain: fast Mixture-of-Experts training on PyTorch + Triton, with projection before GPU time."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import moetrain` must not import torch (the CLI's config commands stay fast).
    if name == "from_hf":
        from moetrain.models.hf import from_hf

        return from_hf
    raise AttributeError(f"module 'moetrain' has no attribute {name!r}")
