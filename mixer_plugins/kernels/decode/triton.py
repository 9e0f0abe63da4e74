"""``triton`` backend of :func:`..ssd_decode_step`: our fused kernels (:mod:`.triton_kernels`), two launches (the
step, then the convolution windows' roll; why two is said there), float32 inside, both states updated in place.
Loaded on first use; chosen first on CUDA for kernels of up to :data:`.triton_kernels.MAX_TAPS` taps and d_state up
to :data:`.triton_kernels.MAX_D_STATE` (larger ones, and float64, run on the ``torch`` backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable

if TYPE_CHECKING:
    from . import DecodeArgs


def _check(device: torch.device, args: Any = None) -> str | None:
    reason = triton_unavailable(device, args)
    if reason is not None or args is None:
        return reason
    tensors = [args.xbc, args.conv_state, args.conv_weight, args.conv_bias, args.dt, args.A_log, args.dt_bias, args.D]
    if any(isinstance(t, Tensor) and t.dtype == torch.float64 for t in tensors):
        return "the Triton kernels compute in float32 at most; float64 inputs run on the torch backend"
    from .triton_kernels import MAX_D_STATE, MAX_TAPS

    taps, d_state = args.conv_weight.shape[1], args.state.shape[-1]
    if taps > MAX_TAPS:
        return f"a kernel of {taps} taps is over the kernels' limit {MAX_TAPS}; the torch backend takes it"
    if d_state > MAX_D_STATE:
        return f"d_state {d_state} is over the kernels' limit {MAX_D_STATE}; the torch backend takes it"
    return None


def impl(args: DecodeArgs) -> Tensor:
    from .triton_kernels import ssd_decode_step_triton

    return ssd_decode_step_triton(args.xbc, args.conv_state, args.conv_weight, args.conv_bias, args.state, args.dt,
                                  args.A_log, args.D, bc_order=args.bc_order, dt_bias=args.dt_bias,
                                  dt_softplus=args.dt_softplus, dt_limit=args.dt_limit, scale=args.scale,
                                  silu=args.silu)


BACKEND = register(Backend(op="decode", name="triton", impl=impl, priority=40, check=_check,
                           automatic_devices=("cuda",)))
