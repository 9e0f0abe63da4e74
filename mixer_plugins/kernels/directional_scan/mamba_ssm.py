"""``mamba_ssm`` backend of :func:`..directional_scan`: mamba-ssm's causal kernel on the sequence, or on its flip
for ``reverse=True`` (CUDA tensors; loaded on first use by :mod:`.._mamba_loader`).

Packed sequences work in both directions: mamba-ssm only compares ``seq_idx`` labels for equality, so the flipped
labels still mark the segments, and the shift is cut where it would carry a token into the next segment."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import mamba_ssm_unavailable

if TYPE_CHECKING:
    from . import DirectionalScanArgs


def impl(args: DirectionalScanArgs) -> Tensor:
    from .._mamba_loader import load

    scan = load().mamba_chunk_scan_combined
    kw = dict(dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_limit=args.dt_limit)
    seq_idx = args.seq_idx
    if not args.reverse:
        y = scan(args.x, args.dt, args.A, args.B, args.C, args.chunk_size, seq_idx=seq_idx, **kw)
    else:
        flipped_idx = None if seq_idx is None else seq_idx.flip(1).contiguous()
        y = scan(args.x.flip(1), args.dt.flip(1), args.A, args.B.flip(1), args.C.flip(1), args.chunk_size,
                 seq_idx=flipped_idx, **kw).flip(1)
    if args.shift:
        # token i reads the output at i - 1 (forward) or i + 1 (reverse), never across a segment boundary
        if args.reverse:
            y = F.pad(y[:, 1:], (0, 0, 0, 0, 0, 1))
            same = None if seq_idx is None else F.pad(seq_idx[:, 1:] == seq_idx[:, :-1], (0, 1))
        else:
            y = F.pad(y[:, :-1], (0, 0, 0, 0, 1, 0))
            same = None if seq_idx is None else F.pad(seq_idx[:, 1:] == seq_idx[:, :-1], (1, 0))
        if same is not None:
            y = y * same[:, :, None, None].to(y.dtype)
    return y


BACKEND = register(Backend(op="directional_scan", name="mamba_ssm", impl=impl, priority=30,
                           check=mamba_ssm_unavailable))
