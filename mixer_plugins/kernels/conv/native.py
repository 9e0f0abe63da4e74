"""``native`` form of :func:`..depthwise_conv1d`: our C++ kernel (``kernels/_native/conv.cpp``), the CPU default.

One pass over blocks of rows with the SiLU fused; the backward recomputes the pre-activation per block and sums the
weight and bias gradients per thread. CPU tensors in float32 or float64 with contiguous channels, eagerly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .._library import Grads
from .._native_check import require_native
from .torch import register_flops


@torch.library.custom_op("mixer_plugins::depthwise_conv1d_native", mutates_args=())
def conv_native(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, silu: bool) -> Tensor:
    """The kernel's forward; ``weight`` (channels, k)."""
    require_native()
    return torch.ops.mixer_plugins_native.conv_forward(x, weight.t().contiguous(),
                                                       None if bias is None else bias.contiguous(), left, silu)


@conv_native.register_fake
def _conv_native_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, silu: bool) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("mixer_plugins::depthwise_conv1d_native_backward", mutates_args=())
def conv_native_backward(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, silu: bool,
                         with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's backward: the gradients of x, weight (channels, k) and bias (empty without one)."""
    return torch.ops.mixer_plugins_native.conv_backward(grad.contiguous().to(x.dtype), x, weight.t().contiguous(),
                                                        None if bias is None else bias.contiguous(), left, silu,
                                                        with_bias)


@conv_native_backward.register_fake
def _conv_native_backward_fake(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, silu: bool,
                               with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(x.shape[-1] if with_bias else 0)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, bias, left, silu = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.left, ctx.silu = left, silu


def _backward(ctx: Any, grad: Tensor) -> Grads:
    x, weight, bias = ctx.saved_tensors
    grad_x, grad_w, grad_b = conv_native_backward(grad, x, weight, bias, ctx.left, ctx.silu, bias is not None)
    return grad_x, grad_w, (grad_b if bias is not None else None), None, None


conv_native.register_autograd(_backward, setup_context=_setup_context)


register_flops(torch.ops.mixer_plugins.depthwise_conv1d_native,
               torch.ops.mixer_plugins.depthwise_conv1d_native_backward)

