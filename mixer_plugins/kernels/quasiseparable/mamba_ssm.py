"""``mamba_ssm`` backend of :func:`..quasiseparable`: mamba-ssm's causal kernel run on the sequence and on its
flip, the way the released Hydra code does it (CUDA tensors; loaded on first use by :mod:`.._mamba_loader`).

Packed sequences (``seq_idx``) work: each direction runs with the segment labels (flipped for the backward one), and
the shift is cut at segment boundaries, as in the ``directional_scan`` backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._mamba_scan import mamba_direction
from .._requirements import mamba_ssm_unavailable

if TYPE_CHECKING:
    from . import QuasiseparableArgs


def impl(args: QuasiseparableArgs) -> Tensor:
    from .._mamba_loader import load

    scan = load().mamba_chunk_scan_combined
    kw = dict(chunk_size=args.chunk_size, shift=args.shift, seq_idx=args.seq_idx, dt_bias=args.dt_bias,
              dt_softplus=args.dt_softplus, dt_limit=args.dt_limit)
    y = mamba_direction(scan, args.x, args.dt, args.A, args.B, args.C, reverse=False, **kw)
    y = y + mamba_direction(scan, args.x, args.dt_bwd, args.A_bwd, args.B_bwd, args.C_bwd, reverse=True, **kw)
    if args.diag is not None:
        y = y + args.diag[..., None].to(y.dtype) * args.x
    return y


BACKEND = register(Backend(op="quasiseparable", name="mamba_ssm", impl=impl, priority=30,
                           check=mamba_ssm_unavailable))
