"""RMSNorm, computed in fp32 and cast back to the input dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim.

    ``forward(x, residual)`` first adds ``residual`` to ``x`` and returns ``(normed, x + residual)``
    (the pre-norm residual stream of decoder layers); without ``residual`` it returns ``normed``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.variance_epsilon = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * xf).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
