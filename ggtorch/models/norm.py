"""RMSNorm, the norm of every family, in a module of its own so that each kind of layer can use it."""

from __future__ import annotations

import torch
from torch import nn

from ggtorch.ops.fused import rms_norm


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in f32 whatever the activation dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
