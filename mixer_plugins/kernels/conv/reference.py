"""``reference`` form of :func:`..depthwise_conv1d`: PyTorch's grouped ``conv1d`` (the oracle)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def conv_reference(x: Tensor, weight: Tensor, bias: Tensor | None, left: int, right: int, silu: bool) -> Tensor:
    """The convolution of x (batch, length, channels) with ``left`` and ``right`` zeros, then SiLU when ``silu``."""
    y = F.conv1d(F.pad(x.transpose(1, 2), (left, right)), weight[:, None], bias, groups=x.shape[-1]).transpose(1, 2)
    return F.silu(y) if silu else y
