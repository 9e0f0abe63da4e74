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
    matrix = toeplitz_matrix(args.taps, args.v.shape[1]).to(args.v.dtype)
    return torch.einsum("bhij,bjhp->bihp", matrix.expand(args.v.shape[0], -1, -1, -1), args.v)


BACKEND = register(Backend(op="toeplitz", name="reference", impl=impl))
