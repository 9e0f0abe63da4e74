"""Depthwise short convolution over time on (batch, length, channels), as a custom op.

The block's short convolution (kernel 4-7 over thousands of channels) is a handful of shifted
multiply-adds. Written that way, on the (batch, length, channels) layout the block already has, forward
and backward are a few vectorized passes, with no transposes. (PyTorch's CPU depthwise ``conv1d``
backward was ~40x slower than this at L=16384, 1792 channels.) It is a ``torch.library`` custom op with
a FLOP formula, so ``FlopCounterMode`` counts it like a convolution: 2 * batch * length * channels * kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

__all__ = ["depthwise_conv1d", "depthwise_conv1d_flops"]


@torch.library.custom_op("mixer_plugins::depthwise_conv1d", mutates_args=())
def _depthwise_conv1d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int) -> Tensor:
    length, k = x.shape[1], weight.shape[1]
    xp = F.pad(x, (0, 0, left, right))
    out = xp[:, 0:length] * weight[:, 0]
    for tap in range(1, k):
        out.addcmul_(xp[:, tap: tap + length], weight[:, tap])
    if bias is not None:
        out += bias
    return out


@_depthwise_conv1d_op.register_fake
def _fake(x, weight, bias, left, right):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    x, weight, bias, left, right = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None
    ctx.pads = (left, right)


@torch.library.custom_op("mixer_plugins::depthwise_conv1d_backward", mutates_args=())
def _depthwise_conv1d_backward_op(grad: Tensor, x: Tensor, weight: Tensor, left: int, right: int,
                                  with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    length, k = x.shape[1], weight.shape[1]
    # y_t = sum_tap w_tap x_{t + tap - left}: the input gradient is the correlation with the flipped kernel
    gp = F.pad(grad, (0, 0, right, left))
    grad_x = gp[:, 0:length] * weight[:, k - 1]
    for tap in range(1, k):
        grad_x.addcmul_(gp[:, tap: tap + length], weight[:, k - 1 - tap])
    xp = F.pad(x, (0, 0, left, right))
    grad_w = torch.stack([(grad * xp[:, tap: tap + length]).sum(dim=(0, 1)) for tap in range(k)], dim=1)
    grad_b = grad.sum(dim=(0, 1)) if with_bias else grad.new_empty(0)
    return grad_x, grad_w, grad_b


@_depthwise_conv1d_backward_op.register_fake
def _backward_fake(grad, x, weight, left, right, with_bias):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), grad.new_empty(grad.shape[-1] if with_bias else 0)


def _backward(ctx, grad: Tensor):
    x, weight = ctx.saved_tensors
    left, right = ctx.pads
    grad_x, grad_w, grad_b = _depthwise_conv1d_backward_op(grad.contiguous(), x, weight, left, right, ctx.has_bias)
    return grad_x, grad_w, (grad_b if ctx.has_bias else None), None, None


_depthwise_conv1d_op.register_autograd(_backward, setup_context=_setup)


def depthwise_conv1d_flops(batch: int, length: int, channels: int, kernel: int) -> int:
    return 2 * batch * length * channels * kernel


@register_flop_formula(torch.ops.mixer_plugins.depthwise_conv1d)
def _flop_formula(x_shape, w_shape, bias_shape, left, right, *args, out_shape=None, **kwargs) -> int:
    return depthwise_conv1d_flops(x_shape[0], x_shape[1], x_shape[2], w_shape[1])


@register_flop_formula(torch.ops.mixer_plugins.depthwise_conv1d_backward)
def _backward_flop_formula(grad_shape, x_shape, w_shape, left, right, with_bias, *args, out_shape=None,
                           **kwargs) -> int:
    # the input gradient and the weight gradient each cost one forward convolution
    return 2 * depthwise_conv1d_flops(x_shape[0], x_shape[1], x_shape[2], w_shape[1])


def depthwise_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, *, causal: bool) -> Tensor:
    """Per-channel convolution over time of ``x`` (batch, length, channels) with ``weight`` (channels, k).

    Centred (``(k-1)//2`` zeros on each side; odd k) or causal (``k-1`` zeros on the left). Computes
    ``y_t = bias + sum_tap weight[:, tap] * x_{t + tap - left}``, the cross-correlation ``nn.Conv1d`` computes.
    """
    k = weight.shape[1]
    left, right = (k - 1, 0) if causal else ((k - 1) // 2, (k - 1) // 2)
    return _depthwise_conv1d_op(x, weight, bias, left, right)  # strided views are fine: the op pads (copies)
