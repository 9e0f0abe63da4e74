"""``torch`` form of :func:`..ssd_decode_step`: the short convolution's step and the scan's step as plain ops.

The oracle of the fused kernels, on any device, and what ``torch.compile`` traces (the native kernel runs eagerly
only). The states are read and written in their own dtype; ``xbc``, the weights and ``dt`` are read in it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..conv.step import causal_conv1d_step
from ..scan.inputs import prepare_dt
from ..scan.step import ssd_step


def decode_torch(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, state: Tensor,
                 dt: Tensor | None, A_log: Tensor | None, D: Tensor | float | None, *, groups: int, bc_order: str,
                 dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float], scale: float,
                 silu: bool) -> Tensor:
    """The step from the short convolution's and the scan's steps (arguments as :func:`.reference.decode_reference`)."""
    state = state
    b, h, p, n = state.shape
    work = state.dtype
    u, conv = causal_conv1d_step(xbc[:, None].to(work), conv_state.to(work), conv_weight,
                                 conv_bias, silu=silu)
    conv_state.copy_(conv)
    x, first, second = u[:, 0].split([h * p, groups * n, groups * n], dim=-1)
    B, C = (first, second) if bc_order == "BC" else (second, first)
    if dt is None:
        dt = x.new_ones(b, 1, h)
    else:
        dt = prepare_dt(dt[:, None].to(work), dt_bias, dt_softplus, dt_limit)
    A = x.new_zeros(h) if A_log is None else -torch.exp(A_log.to(work))
    y, new = ssd_step(x.view(b, 1, h, p), dt, A, B.view(b, 1, groups, n), C.view(b, 1, groups, n),
                      state, D=None)
    state.copy_(new)
    y = y[:, 0]
    if scale != 1.0:
        y = y * scale
    if isinstance(D, Tensor):
        y = y + (D.to(work)[:, None] if D.dim() == 1 else D.to(work)) * x.view(b, h, p)
    elif D is not None:
        y = y + D * x.view(b, h, p)
    return y.reshape(b, h * p).to(xbc.dtype)
