"""Materialized (O(L^2)) semiseparable and quasiseparable matrices: the oracle of the scan ops.

Everything here builds the full L x L matrix per head from the per-token generators and multiplies.
It is exact in float64, simple to read, and is what ``materialize`` of the SSM mixers returns.

Notation (per head h, group g(h) = h // (heads / groups), a_k = A_h * dt_k <= 0, P = cumsum(a),
E = P - a the exclusive cumsum):

* forward (lower) direction, unshifted (Mamba-2 SSD):   m_ij = C_i . B_j exp(P_i - P_j) dt_j,  j <= i
* forward, shifted (Hydra):                              m_ij = C_{i-1} . B_j exp(E_i - P_j) dt_j,  j < i
* backward (upper) direction, unshifted:                  m_ij = C_i . B_j exp(E_j - E_i) dt_j,  j >= i
* backward, shifted (Hydra):                              m_ij = C_{i+1} . B_j exp(E_j - P_i) dt_j,  j > i
* diagonal: m_ii += diag_i

These are the entries of ``QS(X) = shift(SS_f(X)) + flip(shift(SS_b(flip X))) + D X`` (Hydra, Prop. 3.7)
written without flips: the backward direction at original positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .inputs import Direction, ScanInputs, normalize_seq_idx

__all__ = ["reference_scan", "scan_matrix", "scan_reference"]


def _expand_groups(t: Tensor, heads: int) -> Tensor:
    """(b, l, g, n) -> (b, l, h, n): head h reads group h // (heads // g)."""
    groups = t.shape[2]
    if heads % groups:
        raise ValueError(f"number of heads ({heads}) must be a multiple of the number of groups ({groups})")
    return t.repeat_interleave(heads // groups, dim=2)


def _direction_matrix(dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, upper: bool, shift: bool) -> Tensor:
    """(b, h, l, l) matrix of one direction."""
    b, l, h = dt.shape
    a = (dt * A.to(dt.dtype)).transpose(1, 2)                      # (b, h, l)
    P = a.cumsum(-1)
    E = P - a
    Bh = _expand_groups(B, h)
    Ch = _expand_groups(C, h)
    idx = torch.arange(l, device=dt.device)
    if not upper:
        if shift:
            Ch = torch.cat([torch.zeros_like(Ch[:, :1]), Ch[:, :-1]], dim=1)   # C_{i-1}
            log_decay = E[..., :, None] - P[..., None, :]
            allowed = idx[:, None] > idx[None, :]
        else:
            log_decay = P[..., :, None] - P[..., None, :]
            allowed = idx[:, None] >= idx[None, :]
    else:
        if shift:
            Ch = torch.cat([Ch[:, 1:], torch.zeros_like(Ch[:, :1])], dim=1)    # C_{i+1}
            log_decay = E[..., None, :] - P[..., :, None]
            allowed = idx[:, None] < idx[None, :]
        else:
            log_decay = E[..., None, :] - E[..., :, None]
            allowed = idx[:, None] <= idx[None, :]
    decay = torch.exp(log_decay.masked_fill(~allowed, float("-inf")))
    cb = torch.einsum("bihn,bjhn->bhij", Ch, Bh)
    return cb * decay * dt.transpose(1, 2)[..., None, :]


def _matrix(forward: Direction | None, backward: Direction | None, diag: Tensor | None, seq_idx: Tensor | None,
            shift: bool) -> Tensor:
    matrix = None
    if forward is not None:
        matrix = _direction_matrix(forward.dt, forward.A, forward.B, forward.C, upper=False, shift=shift)
    if backward is not None:
        upper = _direction_matrix(backward.dt, backward.A, backward.B, backward.C, upper=True, shift=shift)
        matrix = upper if matrix is None else matrix + upper
    if matrix is None:
        if diag is None:
            raise ValueError("scan_matrix needs at least one direction or a diagonal")
        b, l, h = diag.shape
        matrix = diag.new_zeros(b, h, l, l)
    if diag is not None:
        matrix = matrix + torch.diag_embed(diag.transpose(1, 2))
    if seq_idx is not None:
        same = seq_idx[:, None, :, None] == seq_idx[:, None, None, :]
        matrix = matrix.masked_fill(~same, 0.0)
    return matrix


def _direction(dt: Tensor | None, A: Tensor | None, B: Tensor | None, C: Tensor | None) -> Direction | None:
    return None if dt is None else Direction(dt, A, B, C)


def scan_matrix(
    dt_f: Tensor | None, A_f: Tensor | None, B_f: Tensor | None, C_f: Tensor | None,
    dt_b: Tensor | None = None, A_b: Tensor | None = None, B_b: Tensor | None = None, C_b: Tensor | None = None,
    diag: Tensor | None = None, seq_idx: Tensor | None = None, *, shift: bool = False,
) -> Tensor:
    """The (b, h, l, l) matrix of a forward and/or backward scan plus a diagonal.

    ``dt_*``: (b, l, h) step sizes (already softplus'ed); ``A_*``: (h,); ``B_*``, ``C_*``: (b, l, g, n);
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
    inputs = ScanInputs(x=x, forward=_direction(dt_f, A_f, B_f, C_f), backward=_direction(dt_b, A_b, B_b, C_b),
                        diag=diag, seq_idx=seq_idx, initial_state=initial_state, shift=shift)
    return reference_scan(inputs, return_final_state=return_final_state)


def reference_scan(inputs: ScanInputs, *, return_final_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The scan of ``inputs`` by its materialized matrix: y (b, l, h, p), and the forward direction's state
    after the last token (b, h, p, n) when ``return_final_state``."""
    x, seq_idx, initial_state, shift = inputs.x, inputs.seq_idx, inputs.initial_state, inputs.shift
    if seq_idx is not None:  # idempotent: the public ops pass ids already normalised
        seq_idx = normalize_seq_idx(seq_idx)
    matrix = _matrix(inputs.forward, inputs.backward, inputs.diag, seq_idx, shift)
    y = torch.einsum("bhij,bjhp->bihp", matrix.to(x.dtype), x)
    h = x.shape[2]
    if return_final_state and inputs.forward is None:
        raise ValueError("the final state belongs to the forward direction, which is absent")
    if inputs.forward is not None:
        dt_f, A_f, B_f, C_f = inputs.forward.dt, inputs.forward.A, inputs.forward.B, inputs.forward.C
    if initial_state is not None:
        a = (dt_f * A_f.to(dt_f.dtype))                              # (b, l, h)
        P = a.cumsum(1)
        query_log = (P - a) if shift else P                           # decay from before token 0 to query i
        Ch = _expand_groups(C_f, h)
        if shift:
            Ch = torch.cat([torch.zeros_like(Ch[:, :1]), Ch[:, :-1]], dim=1)
        contrib = torch.einsum("blhn,bhpn->blhp", Ch, initial_state.to(x.dtype)) * torch.exp(query_log)[..., None]
        if shift:
            # The shifted direction reads the state *before* token i; at i = 0 that is C_{-1}, which does not exist.
            contrib[:, 0] = 0
        if seq_idx is not None:
            contrib = contrib * (seq_idx == seq_idx[:, :1])[..., None, None]
        y = y + contrib
    if not return_final_state:
        return y
    a = dt_f * A_f.to(dt_f.dtype)
    total = a.sum(1)                                                  # (b, h)
    to_end = torch.exp(total[:, None] - a.cumsum(1))                 # exp(P_last - P_j)
    weight = to_end * dt_f
    if seq_idx is not None:
        weight = weight * (seq_idx == seq_idx[:, -1:])[..., None]
    Bh = _expand_groups(B_f, h)
    final = torch.einsum("blh,blhn,blhp->bhpn", weight.to(x.dtype), Bh.to(x.dtype), x)
    if initial_state is not None:
        keep = torch.exp(total)
        if seq_idx is not None:
            keep = keep * (seq_idx[:, :1] == seq_idx[:, -1:]).to(keep.dtype)
        final = final + keep[..., None, None].to(x.dtype) * initial_state.to(x.dtype)
    return y, final
