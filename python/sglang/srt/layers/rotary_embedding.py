"""Rotary position embedding (neox / HF ``rotate_half`` style) with HF ``rope_scaling`` types."""

from __future__ import annotations

import math

import torch
from torch import nn


def _default_inv_freq(inv_freq: torch.Tensor, scaling: dict, **_) -> torch.Tensor:
    return inv_freq


def _linear_inv_freq(inv_freq: torch.Tensor, scaling: dict, **_) -> torch.Tensor:
    return inv_freq / float(scaling["factor"])


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, **_) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(scaling: dict, max_position: int) -> float:
    """``factor``, or (as DeepSeek configs may leave it out) max_position / original max."""
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_position / float(scaling["original_max_position_embeddings"])


def yarn_attention_factor(scaling: dict, max_position: int) -> float:
    """The cos/sin multiplier of YaRN: ``attention_factor`` if given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (both set) or mscale(factor)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, max_position)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, *, base: float, head_dim: int, max_position: int,
                   **_) -> torch.Tensor:
    """YaRN (NTK-by-parts): interpolate (divide by ``factor``) the low frequencies, keep the high
    ones, ramp linearly between the correction dims of ``beta_fast`` / ``beta_slow`` rotations."""
    if scaling.get("original_max_position_embeddings") is None:
        raise ValueError(f"rope_scaling type 'yarn' needs original_max_position_embeddings, got {scaling}")
    factor = yarn_factor(scaling, max_position)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + inv_freq * extrapolation


# HF rope_scaling["rope_type"] -> inverse-frequency transform.
ROPE_SCALING_TYPES = {
    "default": _default_inv_freq, "linear": _linear_inv_freq, "llama3": _llama3_inv_freq, "yarn": _yarn_inv_freq,
}


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
    fp32 and the result is cast back to the input dtype. YaRN scales cos/sin by its attention
    factor (as HF does). ``interleaved`` (DeepSeek): feature pairs ``(x0, x1), (x2, x3), ...`` are
    rotated, and the result is laid out de-interleaved (all first, then all second members of the
    pairs), as HF DeepSeek-V3 returns it; q.k is the same as with HF V2's complex layout.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 interleaved: bool = False):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.interleaved = interleaved
        rope_type = rope_type_of(rope_scaling)
        transform = ROPE_SCALING_TYPES[rope_type]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        inv_freq = transform(inv_freq, rope_scaling or {}, base=base, head_dim=head_dim, max_position=max_position)
        attention_factor = yarn_attention_factor(rope_scaling, max_position) if rope_type == "yarn" else 1.0
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cpu"), inv_freq)
        # Computed on CPU so every device gets the same table; stored where the model is built.
        device = torch.get_default_device()
        self.register_buffer("cos_cache", (freqs.cos() * attention_factor).to(device), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * attention_factor).to(device), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if self.interleaved else xf.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``positions`` (T,), ``q`` (T, Hq, D), ``k`` (T, Hk, D) -> rotated (q, k)."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
