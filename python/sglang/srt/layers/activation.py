"""Gated activations, and batch-invariant elementwise functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dim ``2d`` (the gate_up layout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


# CPU elementwise kernels run whole vectors (2 x 16 fp32 per step on AVX-512, with margin) and
# finish a tensor's last partial vector with the scalar routine, whose transcendental functions
# round differently. A token's value would then depend on how many elements share the call.
SIMD_ELEMENTS = 64


def invariant_pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (exp, sigmoid, softplus, cos, silu, ...), computed on
    ``x`` flattened and zero-padded to a multiple of ``SIMD_ELEMENTS`` so every element takes the
    vector path: each element's result does not depend on ``x.numel()``."""
    flat = x.reshape(-1)
    n = flat.numel()
    return fn(F.pad(flat, (0, -n % SIMD_ELEMENTS)))[:n].view(x.shape)
