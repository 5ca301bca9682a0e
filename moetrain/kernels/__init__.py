"""Triton kernels, one file per op family, each next to its plain PyTorch ``*_ref``.

Kernel modules import triton at their own import, so import them only when a Triton backend is
chosen (``moetrain.ops`` does this lazily); this package itself imports nothing.
"""
