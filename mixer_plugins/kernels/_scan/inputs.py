"""The inputs of one chunked/materialized scan, by name, and the argument handling the scan ops share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check

__all__ = ["Direction", "ScanInputs", "check_generators", "check_seq_idx", "normalize_seq_idx", "prepare_dt",
           "upcast"]

SEQ_IDX_MEANING = "a new segment starts wherever the id changes along the row ([0, 0, 1, 1, 0, 0]: three segments)"
"""The one meaning of ``seq_idx`` in every scan op and backend."""


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
    ``backward`` (upper, right to left) direction; ``diag`` (b, l, h); ``seq_idx`` (b, l) integer segment ids,
    already normalised by :func:`normalize_seq_idx` (equal ids <=> same segment; tokens interact only within
    a segment); ``initial_state`` (b, h, p, n), the forward state before token 0;
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


def normalize_seq_idx(seq_idx: Tensor) -> Tensor:
    """Segment ids (b, l) -> int32 ids numbering each row's segments 0, 1, 2, ... left to right, where a new
    segment starts wherever the id changes: ``[0, 0, 1, 1, 0, 0] -> [0, 0, 1, 1, 2, 2]``. After this, equal
    ids mean the same segment, which is what every backend compares (a reused id is a new segment)."""
    change = torch.zeros(seq_idx.shape, dtype=torch.int32, device=seq_idx.device)
    if seq_idx.shape[-1] > 1:
        change[:, 1:] = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    return change.cumsum(-1, dtype=torch.int32)


def check_seq_idx(name: str, seq_idx: Tensor | None, batch: int, length: int,
                  device: torch.device | None = None) -> Tensor | None:
    """Check ``seq_idx`` (an integer (batch, length) tensor, on ``device`` when given) and return it
    normalised by :func:`normalize_seq_idx` (``None`` stays ``None``). Each public scan op calls this once,
    before choosing a backend, so every backend sees the same segments."""
    if seq_idx is None:
        return None
    check(isinstance(seq_idx, Tensor) and tuple(seq_idx.shape) == (batch, length)
          and not seq_idx.is_floating_point() and not seq_idx.is_complex(),
          f"{name}: seq_idx must be an integer (batch, length) = {(batch, length)} tensor, got "
          f"{tuple(seq_idx.shape) if isinstance(seq_idx, Tensor) else type(seq_idx).__name__} "
          f"{getattr(seq_idx, 'dtype', '')}")
    check(device is None or seq_idx.device == device,
          f"{name}: seq_idx is on {seq_idx.device}, the inputs on {device}")
    return normalize_seq_idx(seq_idx)


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
