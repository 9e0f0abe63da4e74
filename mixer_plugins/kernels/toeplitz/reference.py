"""``reference`` backend of :func:`..toeplitz_mix`: the materialized Toeplitz matrix times v (the oracle)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._dispatch import Backend, register

if TYPE_CHECKING:
    from . import ToeplitzArgs

__all__ = ["toeplitz_matrix"]


def toeplitz_matrix(taps: Tensor, length: int) -> Tensor:
    """(b, h, 2L-1) diagonals -> the (b, h, L, L) Toeplitz matrix ``M_ij = taps[i - j + L - 1]``."""
    idx = torch.arange(length, device=taps.device)
    offsets = idx[:, None] - idx[None, :] + length - 1
    return taps[..., offsets]


def impl(args: ToeplitzArgs) -> Tensor:
    length = args.v.shape[1]
    matrix = toeplitz_matrix(args.taps, length).to(args.v.dtype)
    if args.causal:  # keep j <= i by selection: the negative offsets are never read
        idx = torch.arange(length, device=matrix.device)
        matrix = torch.where(idx[:, None] >= idx[None, :], matrix, matrix.new_zeros(()))
    return torch.einsum("bhij,bjhp->bihp", matrix.expand(args.v.shape[0], -1, -1, -1), args.v)


BACKEND = register(Backend(op="toeplitz", name="reference", impl=impl))
