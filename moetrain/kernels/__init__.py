"""Triton kernels, one file per op family, each next to its plain PyTorch ``*_ref`` (the row kernels'
references are the "torch" implementations in moetrain.ops.moe_rows, which must not need triton).

Kernel modules import triton at their own import, so import them only when a Triton backend is
chosen (``moetrain.ops`` does this lazily); this package itself imports nothing.
"""
