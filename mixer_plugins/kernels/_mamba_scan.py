"""One direction of a scan through mamba-ssm's causal kernel, shared by the ``mamba_ssm`` backends of
``directional_scan`` and ``quasiseparable``: the kernel on the sequence, or on its flip for the reverse direction,
then the optional one-token shift, cut at segment boundaries.

Packed sequences work in both directions: mamba-ssm only compares ``seq_idx`` labels for equality, so the flipped
labels still mark the segments, and the shift is cut where it would carry a token into the next segment."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor


def mamba_direction(scan: Callable[..., Tensor], x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
                    chunk_size: int, reverse: bool, shift: bool, seq_idx: Tensor | None, **kw) -> Tensor:
    """``scan`` = mamba-ssm's ``mamba_chunk_scan_combined``; ``kw`` its step-size options (``dt_bias``, ...)."""
    if not reverse:
        y = scan(x, dt, A, B, C, chunk_size, seq_idx=seq_idx, **kw)
    else:
        flipped_idx = None if seq_idx is None else seq_idx.flip(1).contiguous()
        y = scan(x.flip(1), dt.flip(1), A, B.flip(1), C.flip(1), chunk_size, seq_idx=flipped_idx, **kw).flip(1)
    if shift:
        # token i reads the output at i - 1 (forward) or i + 1 (reverse), never across a segment boundary
        if reverse:
            y = F.pad(y[:, 1:], (0, 0, 0, 0, 0, 1))
            same = None if seq_idx is None else F.pad(seq_idx[:, 1:] == seq_idx[:, :-1], (0, 1))
        else:
            y = F.pad(y[:, :-1], (0, 0, 0, 0, 1, 0))
            same = None if seq_idx is None else F.pad(seq_idx[:, 1:] == seq_idx[:, :-1], (1, 0))
        if same is not None:
            y = y * same[:, :, None, None].to(y.dtype)
    return y
