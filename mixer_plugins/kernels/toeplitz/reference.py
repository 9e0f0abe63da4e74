"""``reference`` form of :func:`..toeplitz_mix`: the materialized Toeplitz matrix times v (the oracle)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["toeplitz_matrix"]


def toeplitz_matrix(taps: Tensor, length: int) -> Tensor:
    """(b, h, 2L-1) diagonals -> the (b, h, L, L) Toeplitz matrix ``M_ij = taps[i - j + L - 1]``."""
    idx = torch.arange(length, device=taps.device)
    offsets = idx[:, None] - idx[None, :] + length - 1
    return taps[..., offsets]


def toeplitz_reference(taps: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The mix by its materialized matrix (the oracle)."""
    length = v.shape[1]
    matrix = toeplitz_matrix(taps, length).to(v.dtype)
    if causal:  # keep j <= i by selection: the negative offsets are never read
        idx = torch.arange(length, device=matrix.device)
        matrix = torch.where(idx[:, None] >= idx[None, :], matrix, matrix.new_zeros(()))
    return torch.einsum("bhij,bjhp->bihp", matrix.expand(v.shape[0], -1, -1, -1), v)
