"""``reference`` backend of :func:`..depthwise_conv1d`: PyTorch's grouped ``conv1d`` (the oracle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor

from .._dispatch import Backend, register

if TYPE_CHECKING:
    from . import ConvArgs


def impl(args: ConvArgs) -> Tensor:
    channels = args.x.shape[-1]
    x = F.pad(args.x.transpose(1, 2), (args.left, args.right))
    y = F.conv1d(x, args.weight[:, None], args.bias, groups=channels).transpose(1, 2)
    return F.silu(y) if args.silu else y


BACKEND = register(Backend(op="conv", name="reference", impl=impl))
