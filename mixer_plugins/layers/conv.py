"""The block's depthwise short convolution, as a module over :func:`mixer_plugins.kernels.depthwise_conv1d`."""

from __future__ import annotations

from torch import Tensor, nn

from ..kernels import depthwise_conv1d

__all__ = ["ShortConv"]


class ShortConv(nn.Conv1d):
    """Depthwise convolution over time on (batch, length, channels): centred, or causal; SiLU optionally fused.

    An ``nn.Conv1d`` (Mamba's parameter layout and names: ``weight`` (channels, 1, kernel), ``bias``) whose product
    is our depthwise op: it takes and returns channels-last tensors, and ``causal`` decides the padding
    (``kernel - 1`` on the left, or centred: the kernel size must then be odd).
    """

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = True, causal: bool = False):
        if not causal and kernel_size % 2 == 0:
            raise ValueError(f"a centred (non-causal) short convolution needs an odd kernel size, got {kernel_size}")
        super().__init__(channels, channels, kernel_size, groups=channels, bias=bias)
        self.causal = causal

    def forward(self, u: Tensor, silu: bool = False) -> Tensor:
        """(batch, length, channels) -> (batch, length, channels), followed by SiLU when ``silu``."""
        # squeeze, a view whose backward is a view too (a select's backward would fill a zero tensor and copy)
        return depthwise_conv1d(u, self.weight.squeeze(1), self.bias, causal=self.causal, silu=silu)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", causal={self.causal}"
