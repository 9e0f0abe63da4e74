"""``native`` backend of :func:`..ssd_decode_step`: our C++ kernel (``kernels/_native/decode.cpp``), the CPU default.

One pass per batch row (rows in parallel): the convolution's rolling update over every channel, then each head's
state rows. CPU tensors all in the state's dtype (float32 or float64), eagerly; otherwise the ``torch`` backend runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._dispatch import Backend, register
from .._native_check import native_unavailable

if TYPE_CHECKING:
    from . import DecodeArgs


def _unavailable(device: torch.device, args: Any = None) -> str | None:
    if args is None:
        return native_unavailable(device)
    if not args.state.is_contiguous():
        return "the native kernel updates a contiguous state in place"
    if args.dt is not None and args.dt.stride(-1) != 1:
        return "the native kernel reads dt with contiguous heads"
    tensors = [args.state, args.xbc, args.conv_state, args.conv_weight]
    tensors += [t for t in (args.conv_bias, args.dt, args.A_log, args.dt_bias) if t is not None]
    if isinstance(args.D, Tensor):
        tensors.append(args.D)
    return native_unavailable(device, tensors)


def impl(args: DecodeArgs) -> Tensor:
    D = args.D if isinstance(args.D, Tensor) else None
    return torch.ops.mixer_plugins_native.ssd_decode(
        args.xbc, args.conv_state, args.conv_weight.contiguous(), args.conv_bias, args.state, args.dt, args.A_log,
        None if D is None else D.contiguous(), 0.0 if D is not None or args.D is None else float(args.D),
        args.dt_bias, args.dt_softplus, args.dt_limit[0], args.dt_limit[1], args.scale, args.silu,
        args.bc_order == "CB")


BACKEND = register(Backend(op="decode", name="native", impl=impl, priority=20, check=_unavailable,
                           automatic_devices=("cpu",)))
