"""``triton`` backend of :func:`..depthwise_conv1d`: our fused kernels (:mod:`.triton_kernels`), the SiLU fused in,
one launch forward and two backward (the kernel and a small sum of the weight and bias gradients' partials).
Loaded on first use; chosen first on CUDA for kernels of up to :data:`.triton_kernels.MAX_TAPS` taps (longer ones,
and float64, run on the ``torch`` backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable

if TYPE_CHECKING:
    from . import ConvArgs


def _check(device: torch.device, args: Any = None) -> str | None:
    reason = triton_unavailable(device, args)
    if reason is not None or args is None:
        return reason
    from .triton_kernels import MAX_TAPS

    taps = args.weight.shape[1]
    if taps > MAX_TAPS:
        return f"a kernel of {taps} taps is over the kernels' limit {MAX_TAPS}; the torch backend takes it"
    return None


def impl(args: ConvArgs) -> Tensor:
    from .triton_kernels import depthwise_conv1d_triton

    return depthwise_conv1d_triton(args.x, args.weight, args.bias, args.left, args.right, args.silu)


BACKEND = register(Backend(op="conv", name="triton", impl=impl, priority=40, check=_check,
                           automatic_devices=("cuda",)))
