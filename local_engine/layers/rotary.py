"""Rotary position embedding tables, including Llama-3 and linear rope scaling, computed as HF does."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["build_cos_sin_cache", "inv_frequencies"]


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[max_position, head_dim] float32: cat(cos, sin) of the half-dimension frequencies at each position."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
