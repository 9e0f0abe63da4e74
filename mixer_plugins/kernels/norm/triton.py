"""``triton`` backend of :func:`..gated_rmsnorm`: our fused kernels (:mod:`.triton_kernels`), one launch forward and
one backward (plus one small sum of the gain gradient's per-program partials), float32 inside, y's dtype out.
Loaded on first use; chosen first on CUDA for rows up to :data:`.triton_kernels.MAX_WIDTH` wide (wider rows, and
float64, run on the ``torch`` backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable

if TYPE_CHECKING:
    from . import NormArgs


def _check(device: torch.device, args: Any = None) -> str | None:
    reason = triton_unavailable(device, args)
    if reason is not None or args is None:
        return reason
    from .triton_kernels import MAX_WIDTH

    width = args.y.shape[-1]
    if width > MAX_WIDTH:
        return f"rows of width {width} are over the kernels' limit {MAX_WIDTH}; the torch backend takes them"
    return None


def impl(args: NormArgs) -> Tensor:
    from .triton_kernels import gated_rmsnorm_triton

    return gated_rmsnorm_triton(args.y, args.z, args.weight, args.eps, args.norm_before_gate)


BACKEND = register(Backend(op="norm", name="triton", impl=impl, priority=40, check=_check,
                           automatic_devices=("cuda",)))
