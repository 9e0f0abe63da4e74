"""What the scan's forms share: a direction's generators (:class:`Direction`), the argument checks, the step sizes
(:func:`prepare_dt`), the segment ids (:func:`normalize_seq_idx`) and the chunk length (:func:`chunk_length`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check

__all__ = ["Direction", "check_generators", "check_seq_idx", "chunk_length", "normalize_seq_idx", "prepare_dt"]


class Direction(NamedTuple):
    """The generators of one scan direction: ``dt`` (b, l, h) step sizes, ``A`` (h,), ``B`` and ``C`` (b, l, g, n)."""

    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor


#: Scans whose per-token state, heads x head_dim x state, holds fewer elements than this use ``chunk_size`` as given
#: (so tests at small shapes exercise the chunk boundaries they ask for); larger ones are chunked by
#: :func:`chunk_length`'s rules.
AUTO_CHUNK_MIN_STATE = 4096

#: A tuned scan no longer than ``chunk_size + ONE_CHUNK_STATES * state`` tokens runs as one chunk, with no state work
#: at all. Per token, chunks of Q tokens cost about ``(2 Q + 8 N)`` multiply-adds per head dimension forward and
#: backward (the masked intra-chunk products, half of each zero, and six state products of N), one chunk of L tokens
#: ``2 L``: the two meet at L = Q + 4 N.
ONE_CHUNK_STATES = 4


def chunk_length(length: int, chunk_size: int, heads: int, head_dim: int, state: int) -> int:
    """Tokens per chunk that a scan of ``length`` tokens with the requested ``chunk_size`` uses: the ``torch`` and
    ``native`` backends, the choice of the Triton one-chunk kernels, and the FLOP count ask this function (the Triton
    chunked kernels take chunks of at most 64 tokens, ``ScanGeometry``). It changes speed only, never the result (up
    to rounding).

    A sequence no longer than ``chunk_size`` is one chunk of ``length`` tokens. Scans of at least
    :data:`AUTO_CHUNK_MIN_STATE` state elements per token are tuned: up to ``chunk_size + ONE_CHUNK_STATES * state``
    tokens run as one chunk (a ViT's 197 tokens), longer sequences in **balanced** chunks (the fewest chunks of at
    most ``chunk_size`` tokens, all of one length: 197 tokens at chunk 64 would be 4 chunks of 50, not 256 padded).
    """
    q = max(1, min(int(chunk_size), int(length)))
    if length <= q or heads * head_dim * state < AUTO_CHUNK_MIN_STATE:
        return q
    if length <= chunk_size + ONE_CHUNK_STATES * state:
        return int(length)
    return -(-length // -(-length // q))


def check_generators(name: str, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[int, ...]:
    """Check the shapes of a scan's x and generators; returns (batch, length, heads, head_dim, groups, state)."""
    check(isinstance(x, Tensor) and x.dim() == 4,
          f"{name}: x must be a (batch, length, heads, head_dim) tensor, got "
          f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    b, l, h, p = x.shape
    check(tuple(dt.shape) == (b, l, h), f"{name}: dt must be (batch, length, heads) = {(b, l, h)}, "
                                        f"got {tuple(dt.shape)}")
    check(tuple(A.shape) == (h,), f"{name}: A must be (heads,) = ({h},), got {tuple(A.shape)}")
    check(B.dim() == 4 and B.shape[:2] == (b, l), f"{name}: B must be (batch, length, groups, state), "
                                                 f"got {tuple(B.shape)}")
    check(C.shape == B.shape, f"{name}: C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    g, n = B.shape[2], B.shape[3]
    check(g > 0 and h % g == 0, f"{name}: heads ({h}) must be a multiple of groups ({g})")
    for label, t in (("dt", dt), ("A", A), ("B", B), ("C", C)):
        check(t.is_floating_point(), f"{name}: {label} must be a floating-point tensor, got {t.dtype}")
        check(t.device == x.device, f"{name}: {label} is on {t.device}, x on {x.device}")
    check(x.is_floating_point(), f"{name}: x must be a floating-point tensor, got {x.dtype}")
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
    """Check ``seq_idx`` (an integer (batch, length) tensor, on ``device`` when given) and return it normalised by
    :func:`normalize_seq_idx` (``None`` stays ``None``). Each public scan op calls this once, before choosing a
    backend, so every backend sees the same segments."""
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
