"""The gated RMSNorm of the matrix-mixer block, as a module over :func:`mixer_plugins.kernels.gated_rmsnorm`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import gated_rmsnorm

__all__ = ["GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """``w * y / rms(y) * silu(z)`` over the whole inner width (or ``w * u / rms(u)``, ``u = y * silu(z)``)."""

    def __init__(self, width: int, eps: float = 1e-5, norm_before_gate: bool = True):
        super().__init__()
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(width))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Gain back to ones."""
        self.weight.fill_(1.0)

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        return gated_rmsnorm(y, z, self.weight, self.eps, self.norm_before_gate)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, norm_before_gate={self.norm_before_gate}"
