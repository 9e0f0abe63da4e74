"""The inputs of one chunked/materialized scan, by name, and the argument handling the scan ops share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check

__all__ = ["Direction", "ScanInputs", "check_generators", "check_seq_idx", "prepare_dt", "upcast"]


@dataclass(frozen=True)
class Direction:
    """The generators of one scan direction: ``dt`` (b, l, h) step sizes (>= 0, already through
    :func:`prepare_dt`), ``A`` (h,), ``B`` and ``C`` (b, l, g, n)."""

    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor


@dataclass(frozen=True)
class ScanInputs:
    """Everything one scan reads: ``x`` (b, l, h, p); the ``forward`` (lower, left to right) and/or
    ``backward`` (upper, right to left) direction; ``diag`` (b, l, h); ``seq_idx`` (b, l) integer segment ids
    (tokens interact only within a segment); ``initial_state`` (b, h, p, n), the forward state before token 0;
    ``shift`` (Hydra's: each direction one step off the diagonal); ``chunk_size`` (tokens per chunk)."""

    x: Tensor
    forward: Direction | None = None
    backward: Direction | None = None
    diag: Tensor | None = None
    seq_idx: Tensor | None = None
    initial_state: Tensor | None = None
    shift: bool = False
    chunk_size: int = 64

    def __post_init__(self) -> None:
        if self.initial_state is not None and self.forward is None:
            raise ValueError("the initial state belongs to the forward direction, which is absent")


def check_generators(name: str, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[int, ...]:
    """Check the shapes of a scan's x and generators; returns (batch, length, heads, head_dim, groups, state)."""
    check(x.dim() == 4, f"{name}: x must be (batch, length, heads, head_dim), got shape {tuple(x.shape)}")
    b, l, h, p = x.shape
    check(tuple(dt.shape) == (b, l, h), f"{name}: dt must be (batch, length, heads) = {(b, l, h)}, "
                                        f"got {tuple(dt.shape)}")
    check(tuple(A.shape) == (h,), f"{name}: A must be (heads,) = ({h},), got {tuple(A.shape)}")
    check(B.dim() == 4 and B.shape[:2] == (b, l), f"{name}: B must be (batch, length, groups, state), "
                                                 f"got {tuple(B.shape)}")
    check(C.shape == B.shape, f"{name}: C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    g, n = B.shape[2], B.shape[3]
    check(h % g == 0, f"{name}: heads ({h}) must be a multiple of groups ({g})")
    return b, l, h, p, g, n


def check_seq_idx(name: str, seq_idx: Tensor | None, batch: int, length: int) -> None:
    """``seq_idx``, when given, is an integer (batch, length) tensor."""
    if seq_idx is not None:
        check(tuple(seq_idx.shape) == (batch, length) and not seq_idx.is_floating_point(),
              f"{name}: seq_idx must be an integer (batch, length) = {(batch, length)} tensor, "
              f"got {tuple(seq_idx.shape)} {seq_idx.dtype}")


def prepare_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool,
               dt_limit: tuple[float, float]) -> Tensor:
    """Step sizes as the scan uses them: ``clamp(softplus?(dt + dt_bias), *dt_limit)`` in float32 or wider."""
    if dt.dtype in (torch.float16, torch.bfloat16):
        dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def upcast(*tensors: Tensor | None) -> list[Tensor | None]:
    """Half-precision inputs are scanned in float32 (as mamba-ssm does); float32/float64 stay as they are."""
    return [t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]
