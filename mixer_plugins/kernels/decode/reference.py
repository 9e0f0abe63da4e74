"""``reference`` form of :func:`..ssd_decode_step`: the formulas of the op's docstring as written, batched over rows
and heads (the convolution's window as a roll of the state, the state update and read-out as einsums), computed in
the state's dtype. Never chosen automatically."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..scan.inputs import prepare_dt


def decode_reference(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, state: Tensor,
                     dt: Tensor | None, A_log: Tensor | None, D: Tensor | float | None, *, groups: int, bc_order: str,
                     dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float], scale: float,
                     silu: bool) -> Tensor:
    """The step as written, batched (the arguments of :func:`..ssd_decode_step`; ``groups`` from the widths)."""
    state = state
    b, h, p, n = state.shape
    work = state.dtype
    window = torch.cat([conv_state[..., 1:].to(work), xbc.to(work)[..., None]], dim=-1)
    conv_state.copy_(window)
    u = (window * conv_weight.to(work)).sum(-1)
    if conv_bias is not None:
        u = u + conv_bias.to(work)
    if silu:
        u = F.silu(u)
    x, first, second = u.split([h * p, groups * n, groups * n], dim=-1)
    B, C = (first, second) if bc_order == "BC" else (second, first)
    rep = h // groups
    B = B.view(b, groups, n).repeat_interleave(rep, dim=1)                 # (b, h, n)
    C = C.view(b, groups, n).repeat_interleave(rep, dim=1)
    x = x.view(b, h, p)
    dt = x.new_ones(b, h) if dt is None else prepare_dt(dt.to(work), dt_bias, dt_softplus,
                                                             dt_limit)
    decay = torch.ones_like(dt) if A_log is None else torch.exp(-torch.exp(A_log.to(work)) * dt)
    new = decay[..., None, None] * state + torch.einsum("bh,bhp,bhn->bhpn", dt, x, B)
    state.copy_(new)
    y = scale * torch.einsum("bhpn,bhn->bhp", new, C)
    if isinstance(D, Tensor):
        y = y + (D.to(work)[:, None] if D.dim() == 1 else D.to(work)) * x
    elif D is not None:
        y = y + D * x
    return y.reshape(b, h * p).to(xbc.dtype)
