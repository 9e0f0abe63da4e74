"""``reference`` backend of :func:`..ssd_decode_step`: the formulas of the op's docstring as written, batched over rows
and heads (the convolution's window as a roll of the state, the state update and read-out as einsums), computed in
the state's dtype. Never chosen automatically."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dispatch import Backend, register
from ..scan.inputs import prepare_dt

if TYPE_CHECKING:
    from . import DecodeArgs


def impl(args: DecodeArgs) -> Tensor:
    state = args.state
    b, h, p, n = state.shape
    work = state.dtype
    window = torch.cat([args.conv_state[..., 1:].to(work), args.xbc.to(work)[..., None]], dim=-1)
    args.conv_state.copy_(window)
    u = (window * args.conv_weight.to(work)).sum(-1)
    if args.conv_bias is not None:
        u = u + args.conv_bias.to(work)
    if args.silu:
        u = F.silu(u)
    x, first, second = u.split([h * p, args.groups * n, args.groups * n], dim=-1)
    B, C = (first, second) if args.bc_order == "BC" else (second, first)
    rep = h // args.groups
    B = B.view(b, args.groups, n).repeat_interleave(rep, dim=1)                 # (b, h, n)
    C = C.view(b, args.groups, n).repeat_interleave(rep, dim=1)
    x = x.view(b, h, p)
    dt = x.new_ones(b, h) if args.dt is None else prepare_dt(args.dt.to(work), args.dt_bias, args.dt_softplus,
                                                             args.dt_limit)
    decay = torch.ones_like(dt) if args.A_log is None else torch.exp(-torch.exp(args.A_log.to(work)) * dt)
    new = decay[..., None, None] * state + torch.einsum("bh,bhp,bhn->bhpn", dt, x, B)
    state.copy_(new)
    y = args.scale * torch.einsum("bhpn,bhn->bhp", new, C)
    if isinstance(args.D, Tensor):
        y = y + (args.D.to(work)[:, None] if args.D.dim() == 1 else args.D.to(work)) * x
    elif args.D is not None:
        y = y + args.D * x
    return y.reshape(b, h * p).to(args.xbc.dtype)


BACKEND = register(Backend(op="decode", name="reference", impl=impl))
