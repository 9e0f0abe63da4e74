"""Depthwise short convolution over time on (batch, length, channels), optionally with SiLU fused.

Forms: ``reference`` (PyTorch's grouped ``conv1d``: cuDNN on CUDA), ``torch`` (shifted multiply-adds tile by tile,
a custom op with a FLOP formula), ``native`` (our C++ kernel; the CPU default), ``triton`` (one fused kernel each
way, the SiLU fused in; the CUDA default). :data:`CONV` names them and the automatic order.
"""

from __future__ import annotations

import torch as _torch  # plain ``torch`` would be shadowed by this package's ``torch`` submodule
from torch import Tensor

from .._checks import check
from .._dispatch import Op
from .._native_check import native_unavailable
from .._requirements import triton_unavailable
from .native import conv_native
from .reference import conv_reference
from .torch import conv_torch, depthwise_conv1d_flops

__all__ = ["CONV", "depthwise_conv1d", "depthwise_conv1d_flops"]


def _why_not(backend: str, device: _torch.device, *, x: Tensor | None = None, weight: Tensor | None = None,
             bias: Tensor | None = None) -> str | None:
    """Why ``backend`` cannot convolve ``x`` with ``weight`` on ``device`` (``None`` when it can)."""
    if backend == "native":
        if x is None or weight is None:
            return native_unavailable(device)
        if x.numel() == 0:
            return "empty input"
        if x.stride(-1) != 1:
            return "the native kernel reads contiguous channels"
        return native_unavailable(device, [t for t in (x, weight, bias) if t is not None])
    if backend == "triton":
        reason = triton_unavailable(device, None if x is None else x.dtype)
        if reason is not None or weight is None:
            return reason
        from .triton_kernels import MAX_TAPS

        if weight.shape[1] > MAX_TAPS:
            return (f"a kernel of {weight.shape[1]} taps is over the kernels' limit {MAX_TAPS}; the torch backend "
                    "takes it")
    return None


#: The convolution's forms, and the automatic order per device type (the first that can run the call runs it).
CONV = Op("conv", backends=("reference", "torch", "native", "triton"),
          automatic={"cuda": ("triton", "torch"), "cpu": ("native", "torch")}, why_not=_why_not)


def depthwise_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, *, causal: bool, silu: bool = False,
                     backend: str | None = None) -> Tensor:
    """Per-channel convolution over time of ``x`` (batch, length, channels) with ``weight`` (channels, k).

    Centred (``(k-1)//2`` zeros on each side; odd k) or causal (``k-1`` zeros on the left). Computes
    ``y_t = bias + sum_tap weight[:, tap] * x_{t + tap - left}``, the cross-correlation ``nn.Conv1d`` computes,
    followed by SiLU when ``silu`` (fused: the backward recomputes the pre-activation tile by tile instead of
    storing it). Strided views are fine. ``backend``: see :mod:`mixer_plugins.kernels`.
    """
    check(x.dim() == 3, f"depthwise_conv1d: x must be (batch, length, channels), got shape {tuple(x.shape)}")
    channels = x.shape[-1]
    check(weight.dim() == 2 and weight.shape[0] == channels,
          f"depthwise_conv1d: weight must be (channels, kernel) = ({channels}, k), got {tuple(weight.shape)}")
    check(bias is None or tuple(bias.shape) == (channels,),
          f"depthwise_conv1d: bias must be ({channels},), got {None if bias is None else tuple(bias.shape)}")
    k = weight.shape[1]
    check(causal or k % 2 == 1, f"depthwise_conv1d: a centred (non-causal) kernel must be odd, got {k}")
    left, right = (k - 1, 0) if causal else ((k - 1) // 2, (k - 1) // 2)
    silu = bool(silu)
    name = CONV.choose(backend, x.device, x=x, weight=weight, bias=bias)
    if name == "triton":
        from .triton_kernels import depthwise_conv1d_triton

        return depthwise_conv1d_triton(x, weight, bias, left, right, silu)
    if name == "native":
        return conv_native(x, weight, bias, left, silu)
    if name == "reference":
        return conv_reference(x, weight, bias, left, right, silu)
    return conv_torch(x, weight, bias, left, right, silu)
