"""Depthwise short convolution over time on (batch, length, channels), optionally with SiLU fused.

Backends: ``reference`` (PyTorch's grouped ``conv1d``: cuDNN on CUDA), ``torch`` (shifted multiply-adds tile by
tile, a custom op with a FLOP formula; the default off CUDA), ``triton`` (one fused kernel each way, the SiLU fused
in; the default on CUDA). Each is a module of this folder that registers itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from torch import dtype as DType

from .._checks import check
from .._dispatch import discover_backends, resolve_backend
from .torch import depthwise_conv1d_flops

__all__ = ["ConvArgs", "depthwise_conv1d", "depthwise_conv1d_flops"]


@dataclass(frozen=True)
class ConvArgs:
    """The arguments of one :func:`depthwise_conv1d` call: x (batch, length, channels), weight (channels, k),
    bias (channels,) or None, the zeros ``left`` and ``right`` of the sequence, and whether SiLU follows."""

    x: Tensor
    weight: Tensor
    bias: Tensor | None
    left: int
    right: int
    silu: bool = False

    @property
    def dtype(self) -> DType:
        """x's dtype: what a backend's dtype policy reads."""
        return self.x.dtype


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
    args = ConvArgs(x=x, weight=weight, bias=bias, left=left, right=right, silu=bool(silu))
    return resolve_backend("conv", backend, x.device, args)(args)


discover_backends("conv", __name__)
