"""moetrain: fast Mixture-of-Experts training on PyTorch + Triton, with projection before GPU time."""

__version__ = "0.1.0"
