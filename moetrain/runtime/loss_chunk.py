"""The fused loss's chunk size (``ops.linear_cross_entropy``), a pure function so the planner (no torch) counts the
same chunks the op runs.

The rule: a chunk's [C, V] buffers alive at once (its transient) take at most what the PyTorch path's take at
CHUNK_BYTES of acc logits. The PyTorch path holds the acc logits (4 bytes per logit, 8 for fp64) and, below fp32, the
GEMM's output and then the gradient g (b bytes): 6 bytes per logit for bf16/fp16, 4 for fp32, 8 for fp64, so 384 MiB
at bf16. The Triton kernels (``kernels.cross_entropy``) write g over the GEMM's output: b bytes per logit. So the
kernel path's chunk is the PyTorch path's times 6 / 2 = 3 for bf16/fp16 (the same transient bound, 3x the tokens per
chunk: fewer, larger GEMMs, and a third as many passes over the fp32 dW accumulator) and times 4 / 4 = 1 for fp32.
It is an exact multiple of the PyTorch path's C, so never more bytes than that path's at any V.
"""

CHUNK_BYTES = 256 * 2**20  # one chunk's logits in the accumulation dtype, at most (the PyTorch path)


def transient_bytes_per_logit(itemsize: int, kernels: bool) -> int:
    """Bytes per logit of one chunk's [C, V] buffers alive at once, for logits of ``itemsize`` bytes: the kernels'
    (the GEMM's output, g written over it) or the PyTorch path's (acc logits, and below fp32 the GEMM's output / g)."""
    if kernels:
        return itemsize
    acc = max(itemsize, 4)
    return acc + (itemsize if itemsize < acc else 0)


def chunk_tokens(vocab_rows: int, acc_itemsize: int = 4, kernel_itemsize: int | None = None) -> int:
    """Tokens per chunk so that [C, vocab_rows] logits of ``acc_itemsize`` bytes take at most CHUNK_BYTES: a multiple
    of 128 when that is at least 128 (large GEMMs), else at least 1. With ``kernel_itemsize`` (the Triton path, fp32
    statistics from logits of that many bytes) that chunk times the PyTorch path's transient over the kernels'
    (module docstring): 3x for 2-byte logits, 1x for fp32."""
    c = CHUNK_BYTES // (vocab_rows * acc_itemsize)
    c = c - c % 128 if c >= 128 else max(c, 1)
    if kernel_itemsize:
        c *= transient_bytes_per_logit(kernel_itemsize, False) // transient_bytes_per_logit(kernel_itemsize, True)
    return c
