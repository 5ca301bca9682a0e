"""The fused loss's chunk size (``ops.linear_cross_entropy``), a pure function so the planner (no torch) counts the
same chunks the op runs."""

CHUNK_BYTES = 256 * 2**20  # one chunk's logits in the accumulation dtype, at most


def chunk_tokens(vocab_rows: int, acc_itemsize: int = 4) -> int:
    """Tokens per chunk so that [C, vocab_rows] logits of ``acc_itemsize`` bytes take at most CHUNK_BYTES: a multiple
    of 128 when that is at least 128 (large GEMMs), else at least 1."""
    c = CHUNK_BYTES // (vocab_rows * acc_itemsize)
    return c - c % 128 if c >= 128 else max(c, 1)
