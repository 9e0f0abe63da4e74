"""``reference`` form of :func:`..gated_rmsnorm`: the formula as plain differentiable ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["gated_rmsnorm_reference"]


def gated_rmsnorm_reference(y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
    """The formula, as plain differentiable ops (the oracle of the tests, and the compiled path)."""
    dtype = y.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    y, z = y.to(compute), z.to(compute)
    if norm_before_gate:
        out = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * F.silu(z)
    else:
        u = y * F.silu(z)
        out = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.to(out.dtype)).to(dtype)
