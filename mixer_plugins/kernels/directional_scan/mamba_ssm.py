"""``mamba_ssm`` backend of :func:`..directional_scan`: mamba-ssm's causal kernel on the sequence, or on its flip
for ``reverse=True`` (CUDA tensors; loaded on first use by :mod:`.._mamba_loader`).

Packed sequences work in both directions: mamba-ssm only compares ``seq_idx`` labels for equality, so the flipped
labels still mark the segments, and the shift is cut where it would carry a token into the next segment."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._mamba_scan import mamba_direction
from .._requirements import mamba_ssm_unavailable

if TYPE_CHECKING:
    from . import DirectionalScanArgs


def impl(args: DirectionalScanArgs) -> Tensor:
    from .._mamba_loader import load

    return mamba_direction(load().mamba_chunk_scan_combined, args.x, args.dt, args.A, args.B, args.C,
                           chunk_size=args.chunk_size, reverse=args.reverse, shift=args.shift, seq_idx=args.seq_idx,
                           dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_limit=args.dt_limit)


BACKEND = register(Backend(op="directional_scan", name="mamba_ssm", impl=impl, priority=30,
                           check=mamba_ssm_unavailable))
