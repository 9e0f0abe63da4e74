"""The ``reference`` form of the scan: the materialized (O(L^2)) matrix, the oracle of every other backend.

Everything here builds the full L x L matrix per head from the per-token generators and multiplies. It is exact in
float64, simple to read, and is what ``materialize`` of the SSM mixers returns.

Notation (per head h, group g(h) = h // (heads / groups), a_k = A_h dt_k):

* forward (lower) direction, unshifted (Mamba-2 SSD):  m_ij = C_i . B_j exp(a_{j+1} + ... + a_i) dt_j,      j <= i
* forward, shifted (Hydra):                             m_ij = C_{i-1} . B_j exp(a_{j+1} + ... + a_{i-1}) dt_j, j < i
* backward (upper) direction: the forward one of the time-reversed sequence, read back at original positions
  (``flip(SS(flip x))``): unshifted m_ij = C_i . B_j exp(a_i + ... + a_{j-1}) dt_j for j >= i; shifted
  m_ij = C_{i+1} . B_j exp(a_{i+1} + ... + a_{j-1}) dt_j for j > i
* diagonal: m_ii += diag_i

These are the entries of ``QS(X) = shift(SS_f(X)) + flip(shift(SS_b(flip X))) + D X`` (Hydra, Prop. 3.7).
Each exponent is summed over its own segment (:func:`segment_sums`), never formed as a difference of two long
cumulative sums, so it keeps its precision at any decay.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import MixerInputError
from .inputs import Direction, normalize_seq_idx

__all__ = ["reference_scan", "scan_matrix", "scan_reference", "segment_sums"]


def segment_sums(a: Tensor) -> Tensor:
    """``S[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i`` (0 on the diagonal), ``-inf`` above it.

    Each entry is a cumulative sum that starts at ``j + 1``: no cancellation between two long sums."""
    length = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, length)                            # rows[..., k, j] = a_k
    below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = rows.masked_fill(~below, 0).cumsum(-2)
    keep = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~keep, float("-inf"))


def _expand_groups(t: Tensor, heads: int) -> Tensor:
    """(b, l, g, n) -> (b, l, h, n): head h reads group h // (heads // g)."""
    groups = t.shape[2]
    if heads % groups:
        raise ValueError(f"number of heads ({heads}) must be a multiple of the number of groups ({groups})")
    return t.repeat_interleave(heads // groups, dim=2)


def _lower_matrix(d: Direction, shift: bool) -> Tensor:
    """(b, h, l, l) matrix of the forward (lower) direction."""
    b, l, h = d.dt.shape
    a = (d.dt * d.A.to(d.dt.dtype)).transpose(1, 2)                                 # (b, h, l)
    log_decay = segment_sums(a)                                                       # (b, h, l, l)
    C = _expand_groups(d.C, h)
    if shift:  # row i reads C_{i-1} and the decay up to i - 1: the unshifted rows moved down by one
        C = torch.cat([torch.zeros_like(C[:, :1]), C[:, :-1]], dim=1)
        log_decay = torch.cat([torch.full_like(log_decay[..., :1, :], float("-inf")), log_decay[..., :-1, :]],
                              dim=-2)
    cb = torch.einsum("bihn,bjhn->bhij", C, _expand_groups(d.B, h))
    weights = torch.exp(log_decay) * d.dt.transpose(1, 2)[..., None, :]
    allowed = torch.isfinite(log_decay)  # by selection: a non-finite C.B of an excluded pair never enters
    return torch.where(allowed, cb * weights, torch.zeros((), dtype=cb.dtype, device=cb.device))


def _upper_matrix(d: Direction, shift: bool) -> Tensor:
    """(b, h, l, l) matrix of the backward (upper) direction: the lower one of the flipped sequence, flipped back."""
    flipped = Direction(dt=d.dt.flip(1), A=d.A, B=d.B.flip(1), C=d.C.flip(1))
    return _lower_matrix(flipped, shift).flip(-1, -2)


def _matrix(forward: Direction | None, backward: Direction | None, diag: Tensor | None, seq_idx: Tensor | None,
            shift: bool) -> Tensor:
    parts = []
    if forward is not None:
        parts.append(_lower_matrix(forward, shift))
    if backward is not None:
        parts.append(_upper_matrix(backward, shift))
    if diag is not None:
        parts.append(torch.diag_embed(diag.transpose(1, 2)))
    if not parts:
        raise ValueError("scan_matrix needs at least one direction or a diagonal")
    matrix = parts[0]
    for part in parts[1:]:
        matrix = matrix + part
    if seq_idx is not None:
        same = seq_idx[:, None, :, None] == seq_idx[:, None, None, :]
        matrix = torch.where(same, matrix, torch.zeros((), dtype=matrix.dtype, device=matrix.device))
    return matrix


def _direction(dt: Tensor | None, A: Tensor | None, B: Tensor | None, C: Tensor | None) -> Direction | None:
    if dt is None:
        return None
    if A is None or B is None or C is None:
        raise MixerInputError("a scan direction with step sizes dt needs its A, B and C too")
    return Direction(dt, A, B, C)


def scan_matrix(
    dt_f: Tensor | None, A_f: Tensor | None, B_f: Tensor | None, C_f: Tensor | None,
    dt_b: Tensor | None = None, A_b: Tensor | None = None, B_b: Tensor | None = None, C_b: Tensor | None = None,
    diag: Tensor | None = None, seq_idx: Tensor | None = None, *, shift: bool = False,
) -> Tensor:
    """The (b, h, l, l) matrix of a forward and/or backward scan plus a diagonal.

    ``dt_*``: (b, l, h) step sizes (already through softplus etc.); ``A_*``: (h,); ``B_*``, ``C_*``: (b, l, g, n);
    ``diag``: (b, l, h); ``seq_idx``: (b, l) integer segment ids, a new segment starting wherever the id changes
    along the row ([0, 0, 1, 1, 0, 0] is three segments); tokens interact only within a segment.
    """
    seq_idx = None if seq_idx is None else normalize_seq_idx(seq_idx)
    return _matrix(_direction(dt_f, A_f, B_f, C_f), _direction(dt_b, A_b, B_b, C_b), diag, seq_idx, shift)


def scan_reference(
    x: Tensor,
    dt_f: Tensor | None, A_f: Tensor | None, B_f: Tensor | None, C_f: Tensor | None,
    dt_b: Tensor | None = None, A_b: Tensor | None = None, B_b: Tensor | None = None, C_b: Tensor | None = None,
    diag: Tensor | None = None, seq_idx: Tensor | None = None, initial_state: Tensor | None = None,
    *, shift: bool = False, return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Apply :func:`scan_matrix` to ``x`` (b, l, h, p); forward-direction initial/final states supported.

    ``initial_state`` (b, h, p, n) enters the forward direction before token 0 (only the first segment when
    ``seq_idx`` is given); the final state is the forward state after the last token. ``seq_idx`` as in
    :func:`scan_matrix` (a new segment wherever the id changes).
    """
    seq_idx = None if seq_idx is None else normalize_seq_idx(seq_idx)
    return reference_scan(x, _direction(dt_f, A_f, B_f, C_f), _direction(dt_b, A_b, B_b, C_b), diag=diag,
                          seq_idx=seq_idx, initial_state=initial_state, shift=shift,
                          return_final_state=return_final_state)


def reference_scan(x: Tensor, forward: Direction | None, backward: Direction | None = None, *,
                   diag: Tensor | None = None, seq_idx: Tensor | None = None, initial_state: Tensor | None = None,
                   shift: bool = False, return_final_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The scan of ``x`` (b, l, h, p) by its materialized matrix (step sizes prepared, ``seq_idx`` normalised):
    y (b, l, h, p), and the forward direction's state after the last token (b, h, p, n) when
    ``return_final_state``."""
    if initial_state is not None and forward is None:
        raise ValueError("the initial state belongs to the forward direction, which is absent")
    init = initial_state
    y = torch.einsum("bhij,bjhp->bihp", _matrix(forward, backward, diag, seq_idx, shift).to(x.dtype), x)
    d = forward
    if return_final_state and d is None:
        raise ValueError("the final state belongs to the forward direction, which is absent")
    if d is None or (init is None and not return_final_state):
        return y
    h = x.shape[2]
    a = d.dt * d.A.to(d.dt.dtype)                                                   # (b, l, h)
    first = torch.ones_like(a, dtype=torch.bool) if seq_idx is None else (seq_idx == seq_idx[:, :1])[..., None]
    last = torch.ones_like(a, dtype=torch.bool) if seq_idx is None else (seq_idx == seq_idx[:, -1:])[..., None]
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    if init is not None:
        # decay from before token 0 to query i: a_0 + ... + a_i (a_0 + ... + a_{i-1} shifted, where C_{i-1} is read)
        from_start = a.cumsum(1)
        C = _expand_groups(d.C, h)
        if shift:  # exclusive sums by a shift, not by subtracting a: no cancellation
            from_start = torch.cat([torch.zeros_like(a[:, :1]), from_start[:, :-1]], dim=1)
            C = torch.cat([torch.zeros_like(C[:, :1]), C[:, :-1]], dim=1)
        weight = torch.where(first, torch.exp(from_start), zero)
        y = y + torch.einsum("blhn,bhpn->blhp", C, init.to(x.dtype)) * weight[..., None].to(x.dtype)
    if not return_final_state:
        return y
    after = a.flip(1).cumsum(1).flip(1)                                              # a_j + ... + a_{L-1}
    to_end = torch.cat([after[:, 1:], torch.zeros_like(a[:, :1])], dim=1)            # a_{j+1} + ... + a_{L-1}
    weight = torch.where(last, torch.exp(to_end) * d.dt, zero)
    final = torch.einsum("blh,blhn,blhp->bhpn", weight.to(x.dtype), _expand_groups(d.B, h).to(x.dtype), x)
    if init is not None:
        keep = torch.exp(a.sum(1))                                                   # (b, h)
        if seq_idx is not None:
            keep = torch.where(seq_idx[:, :1] == seq_idx[:, -1:], keep, zero)
        final = final + keep[..., None, None].to(x.dtype) * init.to(x.dtype)
    return y, final

