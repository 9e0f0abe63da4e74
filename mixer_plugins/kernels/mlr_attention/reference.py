"""The materialized oracle of :func:`mixer_plugins.kernels.mlr_attention`: builds the ``L x L`` scores level by
level with dense same-block masks, divides by the level counts, masks, softmax, times ``v``. Exact in any dtype
(float64 included) and independent of the tiled fast path; O(L^2) memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

__all__ = ["mlr_attention_reference", "same_block_mask"]


def same_block_mask(length: int, block_size: Optional[int], device: torch.device | None = None) -> Tensor:
    """Bool (L, L): True where tokens ``i`` and ``j`` share a block of ``block_size`` (aligned at 0; None = global)."""
    if block_size is None:
        return torch.ones(length, length, dtype=torch.bool, device=device)
    block = torch.arange(length, device=device) // block_size
    return block[:, None] == block[None, :]


def mlr_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, ranks: Sequence[int],
                            block_sizes: Sequence[Optional[int]], scales: Sequence[float], causal: bool = False,
                            mask: Tensor | None = None, block_divide: bool = True) -> Tensor:
    """Same arguments and result as :func:`mixer_plugins.kernels.mlr_attention` (already checked by it)."""
    batch, length, heads, _ = q.shape
    device = q.device
    if mask is not None:
        real = mask[:, :, None, None]
        q, k, v = (torch.where(real, t, torch.zeros((), dtype=t.dtype, device=device)) for t in (q, k, v))
    scores = q.new_zeros(batch, heads, length, length)
    counts = torch.zeros(length, length, dtype=torch.long, device=device)
    for q_l, k_l, scale, size in zip(torch.split(q, list(ranks), -1), torch.split(k, list(ranks), -1), scales,
                                     block_sizes):
        same = same_block_mask(length, size, device)
        level = torch.einsum("bihr,bjhr->bhij", q_l, k_l) * scale
        scores = scores + torch.where(same, level, torch.zeros((), dtype=level.dtype, device=device))
        counts += same
    if block_divide:
        scores = scores / counts.clamp(min=1).to(scores.dtype)
    allowed = torch.ones(length, length, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]
    if mask is not None:
        keys = mask | ~mask.any(dim=1, keepdim=True)  # a row with no real token keeps every key (output zeroed)
        allowed = allowed & keys[:, None, None, :]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhij,bjhp->bihp", probs, v)
    if mask is not None:
        out = torch.where(mask[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=device))
    return out
