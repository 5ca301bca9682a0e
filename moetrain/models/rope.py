"""Rotary position embeddings (RoPE) with optional YaRN scaling.

Shapes: S sequence, D rotary dim (even), h heads. Tables cos/sin are [S, D/2] fp32; RoPE is
applied to x [B, S, h, D] in the "two halves" layout (dims i and i + D/2 form a pair), the
layout of Llama/Qwen/GPT-OSS in Hugging Face. (HF DeepSeek-V3 stores its rope dims interleaved
and de-interleaves before rotating; weight import must permute those rows, see models/hf.py.)

YaRN, as Hugging Face transformers implements it for the deepseek_v3 and gpt_oss families:

* Frequencies: inv_freq_i = theta^(-2i/D) (extrapolation) and the same divided by ``factor``
  (interpolation), blended by a linear ramp over the rotary index i in [low, high]:
  ``inv = interp * ramp + extrap * (1 - ramp)``, ramp = clamp((i - low) / (high - low), 0, 1).
  low/high come from the correction dim d(r) = D * ln(L / (2 pi r)) / (2 ln theta), L = original
  max positions, r = beta_fast (low) / beta_slow (high); clamped to [0, D-1]. DeepSeek rounds
  them (floor low, ceil high: ``truncate``); GPT-OSS does not (HF ``truncate: false``).
* cos/sin are multiplied by mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim),
  mscale(s, m) = 0.1 * m * ln(s) + 1 (1 when s <= 1; note m = 0 gives 1). With the defaults
  (mscale 1, all_dim 0) this is GPT-OSS's 0.1 ln(s) + 1 concentration; DeepSeek-V3
  (mscale = mscale_all_dim = 1) gets 1.
* The attention softmax scale is multiplied by mscale(factor, mscale_all_dim)^2 when
  mscale_all_dim > 0 (DeepSeek). (HF falls back to 0.1 ln(s) + 1 for cos/sin whenever mscale or
  mscale_all_dim is unset; the two agree for every released config, where mscale is 1.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature: 0.1 * mscale * ln(scale) + 1, or 1 for scale <= 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_dim(num_rotations: float, dim: int, theta: float, max_position: int) -> float:
    """The rotary dim whose wavelength makes ``num_rotations`` turns over ``max_position`` tokens."""
    return dim * math.log(max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp_range(dim: int, theta: float, max_position: int, beta_fast: float, beta_slow: float,
                    truncate: bool) -> tuple[float, float]:
    low = yarn_correction_dim(beta_fast, dim, theta, max_position)
    high = yarn_correction_dim(beta_slow, dim, theta, max_position)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


@dataclass(frozen=True)
class RopeParams:
    """Everything RoPE needs; plain Python so it can be built on any device (incl. meta)."""

    dim: int
    theta: float = 10000.0
    yarn: bool = False
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @classmethod
    def from_model_config(cls, m, dim: int) -> "RopeParams":
        """From a ``ModelConfig``; ``dim`` is the rotary dim (GQA head_dim, MLA qk_rope_head_dim)."""
        truncate = m.yarn_truncate
        if truncate is None:
            # Unset: GPT-OSS (the family with attention sinks) uses unrounded ramp bounds,
            # DeepSeek and every other YaRN model rounds them.
            truncate = not m.attention_sinks
        return cls(
            dim=dim, theta=m.rope_theta, yarn=m.rope_scaling == "yarn", factor=m.rope_scaling_factor,
            original_max_position=m.rope_original_max_position, beta_fast=m.yarn_beta_fast,
            beta_slow=m.yarn_beta_slow, mscale=m.yarn_mscale, mscale_all_dim=m.yarn_mscale_all_dim,
            truncate=bool(truncate),
        )

    @property
    def cos_sin_scale(self) -> float:
        """Factor on the cos/sin tables (HF ``attention_scaling``)."""
        if not self.yarn:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_scale_multiplier(self) -> float:
        """Factor on the attention softmax scale (DeepSeek's mscale_all_dim correction)."""
        if self.yarn and self.mscale_all_dim > 0:
            return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2
        return 1.0

    def inv_freq(self, device=None) -> torch.Tensor:
        """[D/2] fp32 inverse frequencies (radians per token)."""
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        pos_freqs = self.theta ** exponents
        extrap = 1.0 / pos_freqs
        if not self.yarn:
            return extrap
        interp = 1.0 / (self.factor * pos_freqs)
        low, high = yarn_ramp_range(self.dim, self.theta, self.original_max_position,
                                    self.beta_fast, self.beta_slow, self.truncate)
        if low == high:
            high += 0.001  # avoid 0/0 in the ramp
        ramp = ((torch.arange(self.dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        return interp * ramp + extrap * (1 - ramp)

    def tables(self, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, D/2] fp32 for positions 0..S-1, scaled by ``cos_sin_scale``."""
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq(device))
        scale = self.cos_sin_scale
        return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, h, D] by the tables cos/sin [S, D/2]; computed in x.dtype (as HF)."""
    c = cos[:, None, :].to(x.dtype)
    s = sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
