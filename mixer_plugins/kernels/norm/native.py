"""``native`` form of :func:`..gated_rmsnorm`: our C++ kernel (``kernels/_native/norm.cpp``), the CPU default.

One pass per row forward and backward, the gain gradient summed per thread. CPU tensors in float32 or float64 with
contiguous rows, eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._library import Grads


def _rows(t: Tensor) -> Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


class _NativeNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
        weight = weight.contiguous()
        ctx.save_for_backward(y, z, weight)
        ctx.eps, ctx.norm_before_gate = eps, norm_before_gate
        return _forward(y, z, weight, eps, norm_before_gate)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Grads:
        y, z, weight = ctx.saved_tensors
        gy, gz, gw = torch.ops.mixer_plugins_native.norm_backward(
            _rows(grad).contiguous().to(y.dtype), _rows(y), _rows(z), weight, ctx.eps, ctx.norm_before_gate)
        need_y, need_z, need_w = ctx.needs_input_grad[:3]
        return (gy.view(y.shape) if need_y else None, gz.view(z.shape) if need_z else None,
                gw if need_w else None, None, None)


def _forward(y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
    out = torch.ops.mixer_plugins_native.norm_forward(_rows(y), _rows(z), weight, eps, norm_before_gate)
    return out if y.dim() == 2 else out.view(y.shape)


def norm_native(y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
    """The norm on the native kernel (CPU, one dtype, contiguous rows)."""
    if not (torch.is_grad_enabled() and (y.requires_grad or z.requires_grad or weight.requires_grad)):
        # nothing to differentiate (inference, a decoding step): the kernel without the autograd Function's cost
        return _forward(y, z, weight.contiguous(), float(eps), bool(norm_before_gate))
    return _NativeNorm.apply(y, z, weight, float(eps), bool(norm_before_gate))
