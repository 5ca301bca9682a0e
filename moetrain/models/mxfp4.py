"""MXFP4 dequantization (the expert weights of the released GPT-OSS checkpoints).

Legend: R rows (output features), G blocks of 32 values along the input dim, E experts.
A checkpoint stores ``<name>_blocks`` [..., R, G, 16] uint8 (two 4-bit E2M1 codes per byte, the
low nibble first) and ``<name>_scales`` [..., R, G] uint8 (one shared power-of-two exponent
per block of 32, biased by 127). Value = E2M1(code) * 2^(scale - 127), where the E2M1 code
is sign (bit 3) + magnitude (bits 0-2) from {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
The result is [..., R, G*32]: rows are output features, as in a torch Linear weight.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     chunk_rows: int = 1 << 16) -> torch.Tensor:
    """blocks [..., R, G, 16] uint8, scales [..., R, G] uint8 -> [..., R, G*32] in ``dtype``.

    Works through ``chunk_rows`` (row, block) pairs at a time, so the int64 lookup indices never
    cost more than a small multiple of the output chunk. Exact for bf16/fp32 outputs whose
    exponent range holds the value (E2M1 needs 2 mantissa bits).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8; got {blocks.dtype} / {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         "(expected blocks [..., G, 16] and scales [..., G])")
    *lead, G, _ = blocks.shape
    flat_blocks = blocks.reshape(-1, 16)
    flat_scales = scales.reshape(-1)
    n = flat_blocks.shape[0]
    # fp32 work: 2^(s-127) spans 2^-127..2^128, the E2M1 products stay exact in fp32 except the
    # extreme exponents, which no trained weight uses.
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(n, 32, dtype=dtype, device=blocks.device)
    for start in range(0, n, chunk_rows):
        b = flat_blocks[start:start + chunk_rows]
        vals = torch.empty(b.shape[0], 32, dtype=torch.float32, device=blocks.device)
        vals[:, 0::2] = lut[(b & 0x0F).long()]
        vals[:, 1::2] = lut[(b >> 4).long()]
        exp = flat_scales[start:start + chunk_rows].to(torch.int32) - SCALE_BIAS
        out[start:start + chunk_rows] = torch.ldexp(vals, exp.unsqueeze(1).to(torch.float32)).to(dtype)
    return out.reshape(*lead, G * 32)
