"""The dense oracle of :func:`mixer_plugins.kernels.local_attention`: the full ``L x L`` scores with an explicit
allowed-pair matrix built from positions, a masked softmax, times ``v``. Exact in any dtype (float64 included),
independent of the blocked and Triton paths; O(L^2) memory."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["allowed_pairs", "local_attention_reference"]


def allowed_pairs(length: int, window: int, causal: bool, num_global: int = 0,
                  device: torch.device | None = None) -> Tensor:
    """Bool (L, L): query ``i`` may attend key ``j`` (band or global token, and ``j <= i`` when causal; no padding)."""
    pos = torch.arange(length, device=device)
    allowed = (pos[:, None] - pos[None, :]).abs() <= window
    allowed = allowed | (pos[:, None] < num_global) | (pos[None, :] < num_global)
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])
    return allowed


def local_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool = False,
                              mask: Tensor | None = None, scale: float, num_global: int = 0) -> Tensor:
    """Same arguments and result as :func:`mixer_plugins.kernels.local_attention` (already checked by it)."""
    length = q.shape[1]
    device = q.device
    zero = torch.zeros((), dtype=q.dtype, device=device)
    if mask is not None:
        real = mask[:, :, None, None]
        q, k, v = (torch.where(real, t, zero) for t in (q, k, v))
    scores = torch.einsum("bihe,bjhe->bhij", q, k) * scale
    allowed = allowed_pairs(length, window, causal, num_global, device)[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    probs = torch.where(allowed.any(-1, keepdim=True), probs, zero)  # a row with no allowed key (a pad query): 0
    out = torch.einsum("bhij,bjhp->bihp", probs, v)
    if mask is not None:
        out = torch.where(mask[:, :, None, None], out, zero)
    return out
