"""Rotary position embedding (neox / HF ``rotate_half`` style) with HF ``rope_scaling`` types."""

from __future__ import annotations

import math

import torch
from torch import nn


def _default_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    return inv_freq


def _linear_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    return inv_freq / float(scaling["factor"])


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


# HF rope_scaling["rope_type"] -> inverse-frequency transform.
ROPE_SCALING_TYPES = {"default": _default_inv_freq, "linear": _linear_inv_freq, "llama3": _llama3_inv_freq}


def rope_type_of(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {sorted(ROPE_SCALING_TYPES)}")
    return rope_type


class RotaryEmbedding(nn.Module):
    """Rotates the first ``head_dim`` features of q and k by their token positions.

    cos/sin are precomputed in fp32 for positions ``[0, max_position)``; the rotation runs in
    fp32 and the result is cast back to the input dtype.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        transform = ROPE_SCALING_TYPES[rope_type_of(rope_scaling)]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        inv_freq = transform(inv_freq, rope_scaling or {})
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cpu"), inv_freq)
        # Computed on CPU so every device gets the same table; stored where the model is built.
        device = torch.get_default_device()
        self.register_buffer("cos_cache", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(device), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``positions`` (T,), ``q`` (T, Hq, D), ``k`` (T, Hk, D) -> rotated (q, k)."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
