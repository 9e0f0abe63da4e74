"""``mamba_ssm`` backend of :func:`..quasiseparable`: mamba-ssm's causal kernel run on the sequence and on its
flip, the way the released Hydra code does it (CUDA tensors; loaded on first use by :mod:`.._mamba_loader`).
Packed sequences (``seq_idx``) are refused here, so that this backend never silently mixes segments (the
``directional_scan`` backend runs them one direction at a time)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import mamba_ssm_unavailable

if TYPE_CHECKING:
    from . import QuasiseparableArgs


def _unavailable(device: torch.device, args: Any) -> str | None:
    reason = mamba_ssm_unavailable(device, args)
    if reason is None and args is not None and args.seq_idx is not None:
        return "the mamba_ssm backend of quasiseparable does not support seq_idx; use backend='torch'"
    return reason


def impl(args: QuasiseparableArgs) -> Tensor:
    from .._mamba_loader import load

    mamba_chunk_scan_combined = load().mamba_chunk_scan_combined
    kw = dict(dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_limit=args.dt_limit)
    y_f = mamba_chunk_scan_combined(args.x, args.dt, args.A, args.B, args.C, args.chunk_size, **kw)
    y_b = mamba_chunk_scan_combined(args.x.flip(1), args.dt_bwd.flip(1), args.A_bwd, args.B_bwd.flip(1),
                                    args.C_bwd.flip(1), args.chunk_size, **kw).flip(1)
    if args.shift:
        y_f = F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0))
        y_b = F.pad(y_b[:, 1:], (0, 0, 0, 0, 0, 1))
    y = y_f + y_b
    if args.diag is not None:
        y = y + args.diag[..., None].to(y.dtype) * args.x
    return y


BACKEND = register(Backend(op="quasiseparable", name="mamba_ssm", impl=impl, priority=30, check=_unavailable))
