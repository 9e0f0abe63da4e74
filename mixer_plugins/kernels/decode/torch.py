"""``torch`` backend of :func:`..ssd_decode_step`: the short convolution's step and the scan's step as plain ops.

The oracle of the fused kernels, on any device, and what ``torch.compile`` traces (the native kernel runs eagerly
only). The states are read and written in their own dtype; ``xbc``, the weights and ``dt`` are read in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._dispatch import Backend, register
from ..conv.step import causal_conv1d_step
from ..scan.inputs import prepare_dt
from ..scan.step import ssd_step

if TYPE_CHECKING:
    from . import DecodeArgs


def impl(args: DecodeArgs) -> Tensor:
    state = args.state
    b, h, p, n = state.shape
    work = state.dtype
    u, conv = causal_conv1d_step(args.xbc[:, None].to(work), args.conv_state.to(work), args.conv_weight,
                                 args.conv_bias, silu=args.silu)
    args.conv_state.copy_(conv)
    x, first, second = u[:, 0].split([h * p, args.groups * n, args.groups * n], dim=-1)
    B, C = (first, second) if args.bc_order == "BC" else (second, first)
    if args.dt is None:
        dt = x.new_ones(b, 1, h)
    else:
        dt = prepare_dt(args.dt[:, None].to(work), args.dt_bias, args.dt_softplus, args.dt_limit)
    A = x.new_zeros(h) if args.A_log is None else -torch.exp(args.A_log.to(work))
    y, new = ssd_step(x.view(b, 1, h, p), dt, A, B.view(b, 1, args.groups, n), C.view(b, 1, args.groups, n),
                      state, D=None)
    state.copy_(new)
    y = y[:, 0]
    if args.scale != 1.0:
        y = y * args.scale
    if isinstance(args.D, Tensor):
        y = y + (args.D.to(work)[:, None] if args.D.dim() == 1 else args.D.to(work)) * x.view(b, h, p)
    elif args.D is not None:
        y = y + args.D * x.view(b, h, p)
    return y.reshape(b, h * p).to(args.xbc.dtype)


BACKEND = register(Backend(op="decode", name="torch", impl=impl, priority=10))
