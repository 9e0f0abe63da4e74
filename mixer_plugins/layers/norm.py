"""The gated RMSNorm of the matrix-mixer block, as a module over :func:`mixer_plugins.kernels.gated_rmsnorm`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kernels import gated_rmsnorm

__all__ = ["GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """``w * y / rms(y) * silu(z)`` over the whole inner width (or ``w * u / rms(u)``, ``u = y * silu(z)``); with
    ``groups > 1`` the statistics are per group of ``width / groups`` channels (Mamba-2's ``group_size``)."""

    def __init__(self, width: int, eps: float = 1e-5, norm_before_gate: bool = True, groups: int = 1):
        super().__init__()
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.groups = groups
        self.weight = nn.Parameter(torch.ones(width))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Gain back to ones."""
        self.weight.fill_(1.0)

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        if self.groups == 1:
            return gated_rmsnorm(y, z, self.weight, self.eps, self.norm_before_gate)
        g = self.groups
        ones = torch.ones(y.shape[-1] // g, dtype=self.weight.dtype, device=y.device)
        normed = gated_rmsnorm(y.unflatten(-1, (g, -1)), z.unflatten(-1, (g, -1)), ones, self.eps,
                               self.norm_before_gate).flatten(-2)
        return normed * self.weight.to(normed.dtype)

    def extra_repr(self) -> str:
        groups = f", groups={self.groups}" if self.groups > 1 else ""
        return f"{self.weight.shape[0]}, eps={self.eps}, norm_before_gate={self.norm_before_gate}{groups}"
