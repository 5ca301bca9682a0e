"""FP8 quantization: the recipes' data and scales, and the dequantization every FP8 kernel is tested against.

Legend: M rows (tokens), K the reduced dimension, N output features, G groups (experts). A tensor is quantized over
its last two dims [R, C] (leading dims, e.g. the experts of a stacked weight, are batched), in tiles of r x c
elements that share one scale:

    recipe      activations / gradients [M, K]      weights [G, N, K]              scale
    tensorwise  the whole matrix                    each expert's whole matrix     fp32
    rowwise     1 x K (one per row)                 1 x K (one per output row)     fp32
    blockwise   1 x 128 along K                     128 x 128 blocks               fp32
    mxfp8       1 x 32 along K                      1 x 32 along K                 power of two (E8M0)

Data is E4M3 (largest finite 448) for every tensor, gradients included: with per-tile scales E4M3's extra
mantissa bit is worth more than E5M2's range, the choice DeepSeek-V3 made for its 1 x 128 / 128 x 128 recipe.
A tile's scale is amax / 448 and its values are multiplied by 448 / amax (one division per tile), so its largest
value lands on 448 (fp32 scales); MX scales are rounded up to the next power of two (nothing saturates). An all-zero tile keeps scale 1. Dimensions that
are not a multiple of the tile are covered by a last partial tile (scaled by its own values).

Square weight blocks serve both orientations: the data gradient reads the same blocks transposed. The other
recipes need a second copy of the weight scaled along N for it (``quantize(w.transpose(-1, -2), ...)``). The
weight gradient quantizes dY and X along M: rowwise per group (one scale per column of each group's rows),
tensorwise over the whole tensor, blockwise and mxfp8 in tiles of consecutive rows (``ops.grouped_gemm_fp8``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
E4M3_MAX = 448.0
BLOCK = 128
MX_BLOCK = 32


@dataclass
class Quantized:
    """FP8 data with its tile scales. data [..., R, C] float8_e4m3fn; scale [..., ceil(R / r), ceil(C / c)] float32
    (powers of two for mxfp8); tile (r, c)."""
    data: torch.Tensor
    scale: torch.Tensor
    tile: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """fp32 [..., R, C]: each element times its tile's scale."""
        r, c = self.tile
        R, C = self.data.shape[-2:]
        scale = self.scale.repeat_interleave(r, dim=-2)[..., :R, :].repeat_interleave(c, dim=-1)[..., :C]
        return self.data.float() * scale


def tile_of(recipe: str, role: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """The tile (r, c) of ``recipe`` for a tensor of ``shape`` (last two dims [R, C]) in ``role``: "activation"
    (activations and gradients) or "weight"."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; valid: {', '.join(RECIPES)}")
    if role not in ("activation", "weight"):
        raise ValueError(f"role must be activation or weight, not {role!r}")
    R, C = shape[-2:]
    if recipe == "tensorwise":
        return max(R, 1), max(C, 1)
    if recipe == "rowwise":
        return 1, max(C, 1)
    if recipe == "blockwise":
        return (BLOCK, BLOCK) if role == "weight" else (1, BLOCK)
    return 1, MX_BLOCK


def quantize(x: torch.Tensor, recipe: str, role: str = "activation") -> Quantized:
    """x [..., R, C] (any float dtype) -> its FP8 tiles under ``recipe`` (see the module doc)."""
    return quantize_tiles(x, tile_of(recipe, role, tuple(x.shape)), power_of_two=recipe == "mxfp8")


def quantize_tiles(x: torch.Tensor, tile: tuple[int, int], power_of_two: bool = False) -> Quantized:
    """x [..., R, C] in tiles of r x c, each scaled so that its amax maps to 448 (rounded up to a power of two
    where ``power_of_two``) -> Quantized. Partial tiles at the ends are scaled by their own values."""
    if x.dim() < 2:
        raise ValueError(f"quantize: x must have at least 2 dims, got {tuple(x.shape)}")
    r, c = tile
    *lead, R, C = x.shape
    tr, tc = math.ceil(R / r), math.ceil(C / c)
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, tc * c - C, 0, tr * r - R))
    tiles = padded.reshape(*lead, tr, r, tc, c)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., tr, tc]
    # the elements multiplied by the tile's inverse, as the kernels do (an elementwise division costs them registers)
    scale, inverse = scale_and_inverse(amax)
    if power_of_two:
        scale = power_of_two_at_least(scale)
        inverse = 1.0 / scale  # exact: a power of two
    scaled = tiles * inverse[..., :, None, :, None]
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(*lead, tr * r, tc * c)[..., :R, :C]
    return Quantized(data.contiguous(), scale, (r, c))


def scale_and_inverse(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 amax (any shape) -> (amax / 448, 448 / amax), (1, 1) where amax is 0: one IEEE division each, by a
    tensor (torch on CUDA divides by a Python scalar through its reciprocal), the kernels' rule bit for bit."""
    amax = amax.float()
    full = torch.full_like(amax, E4M3_MAX)
    scale = torch.where(amax > 0, amax / full, torch.ones_like(amax))
    inverse = torch.where(amax > 0, full / amax, torch.ones_like(amax))
    return scale, inverse


def power_of_two_at_least(s: torch.Tensor) -> torch.Tensor:
    """fp32 s > 0 (any shape) -> the smallest power of two >= s, at least 2^-127 (E8M0's smallest scale), exactly:
    from frexp's exponent (s = m 2^e, m in [0.5, 1)). ceil(log2(s)) in fp32 is not exact: log2 of s just above 2^k
    rounds to k for |k| >= 2, which would round such a scale down and saturate the tile's amax."""
    m, e = torch.frexp(s.float())
    e = torch.where(m == 0.5, e - 1, e).clamp(-127, 127)
    return torch.ldexp(torch.ones_like(s, dtype=torch.float32), e)


def round_trip(x: torch.Tensor, recipe: str, role: str = "activation") -> torch.Tensor:
    """fp32: x quantized under ``recipe`` and dequantized (what an FP8 GEMM sees of x)."""
    return quantize(x, recipe, role).dequantize()


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``approx`` against ``reference`` in dB: 10 log10(|ref|^2 / |ref - approx|^2)."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    signal = ref.pow(2).sum()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10((signal / noise).item())
