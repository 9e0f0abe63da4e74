"""``native`` backend of :func:`..gated_rmsnorm`: our C++ kernel (``kernels/_native/norm.cpp``), the CPU default.

One pass per row forward and backward, the gain gradient summed per thread. CPU tensors in float32 or float64 with
contiguous rows, eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._dispatch import Backend, register
from .._library import Grads
from .._native_check import native_unavailable

if TYPE_CHECKING:
    from . import NormArgs


def _unavailable(device: torch.device, args: Any = None) -> str | None:
    if args is None:
        return native_unavailable(device)
    if args.y.numel() == 0:
        return "empty input"
    if args.y.stride(-1) != 1 or args.z.stride(-1) != 1:
        return "the native kernel reads contiguous rows"
    return native_unavailable(device, [args.y, args.z, args.weight])


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


def impl(args: NormArgs) -> Tensor:
    if not (torch.is_grad_enabled() and (args.y.requires_grad or args.z.requires_grad or args.weight.requires_grad)):
        # nothing to differentiate (inference, a decoding step): the kernel without the autograd Function's cost
        return _forward(args.y, args.z, args.weight.contiguous(), float(args.eps), bool(args.norm_before_gate))
    return _NativeNorm.apply(args.y, args.z, args.weight, float(args.eps), bool(args.norm_before_gate))


BACKEND = register(Backend(op="norm", name="native", impl=impl, priority=20, check=_unavailable,
                           automatic_devices=("cpu",)))
