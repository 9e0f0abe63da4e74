"""The chunked scan in plain PyTorch (the SSD algorithm of Mamba-2), in named phases (the ``torch`` backend).

O(L) memory (no L x L tensor), any device, any floating dtype, differentiable by autograd, traceable by
``torch.compile`` and ``torch.export``. One direction runs left to right in chunks of Q tokens (:func:`chunk_length`),
with ``a = A dt`` per token. Every log decay is a sum over its own tokens, never a difference of two chunk-wide
cumulative sums (:func:`chunk_decays`): so its rounding is relative to its own size, and autograd's gradient with
respect to each ``a_k`` adds only the terms whose decay spans ``k``, each with its own bounded weight (no large sums
that cancel, however strong the decay):

1. :func:`chunk_decays` — per chunk, the pair sums ``S_ij = a_{j+1} + ... + a_i`` (``... + a_{i-1}`` shifted), the
   prefix sums ``q_i`` (``a_0 + ... + a_i``, or up to ``a_{i-1}`` shifted) with which query rows read the entering
   state, the suffix sums ``s_j = a_{j+1} + ... + a_last`` with which tokens enter the chunk's own state, and the
   chunk's total;
2. :func:`chunk_states` — what each chunk leaves behind: ``S_c = sum_j exp(s_j) dt_j B_j x_j^T``;
3. :func:`state_passing` — the state entering each chunk: ``H_{c+1} = exp(total_c) H_c + S_c`` from the initial
   state (a short loop over chunks);
4. :func:`chunk_output` — ``y_i = sum_{j<=i} (C~_i . B_j) exp(S_ij) dt_j x_j + exp(q_i) C~_i . H_c``
   (``j < i`` and ``C~_i = C_{i-1}`` when shifted).

The backward (upper) direction is the forward one on the time-reversed sequence, read back in original order. With
``seq_idx`` (packed sequences) pairs across segments are excluded inside a chunk and the states are cut between
chunks, so no direction, and no shift, crosses a segment start. Every exclusion is a selection (``torch.where``),
never a multiplication by zero, so a non-finite ``dt``, ``B`` or ``C`` of a token reaches only the tokens that see it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .inputs import Direction, chunk_length

__all__ = ["ChunkDecays", "chunk_decays", "chunk_output", "chunk_states", "scan_chunked", "state_passing"]


class ChunkDecays(NamedTuple):
    """The log decays of one direction's chunks, each summed over its own tokens (b, c chunks of Q tokens, h heads):

    * ``pair`` (b, c, Q, Q, h): ``a_{j+1} + ... + a_i`` at (i, j) for ``j < i`` (``... + a_{i-1}`` when shifted),
      0 on and above the diagonal (where the mask of :func:`chunk_output` excludes or keeps the pair);
    * ``prefix`` (b, c, Q, h): ``a_0 + ... + a_i`` (``... + a_{i-1}`` when shifted), what row i's read-out of the
      entering state decays by;
    * ``suffix`` (b, c, Q, h): ``a_{j+1} + ... + a_last``, what token j decays by until it leaves the chunk;
    * ``total`` (b, c, h): the whole chunk's sum, the carry of the entering state.
    """

    pair: Tensor
    prefix: Tensor
    suffix: Tensor
    total: Tensor


def _zero(t: Tensor) -> Tensor:
    return torch.zeros((), dtype=t.dtype, device=t.device)


def _chunks(t: Tensor, q: int) -> Tensor:
    """(b, l, ...) -> (b, c, q, ...), zero-padded along time to whole chunks."""
    pad = -t.shape[1] % q
    if pad:
        t = torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)
    return t.unflatten(1, (t.shape[1] // q, q))


def _shift_right(t: Tensor, dim: int) -> Tensor:
    """``t`` moved one step along ``dim``, a zero entering first."""
    first = torch.zeros_like(t.narrow(dim, 0, 1))
    return torch.cat([first, t.narrow(dim, 0, t.shape[dim] - 1)], dim=dim)


def _shift_left(t: Tensor, dim: int) -> Tensor:
    """``t`` moved one step back along ``dim``, a zero entering last."""
    last = torch.zeros_like(t.narrow(dim, 0, 1))
    return torch.cat([t.narrow(dim, 1, t.shape[dim] - 1), last], dim=dim)


def chunk_decays(dt: Tensor, A: Tensor, q: int, shift: bool) -> ChunkDecays:
    """The log decays of one direction in chunks of ``q`` tokens (:class:`ChunkDecays`): ``dt`` (b, l, h) prepared,
    ``A`` (h,). The pair sums are cumulative sums down each column of the masked ``a`` (as the reference's
    :func:`.reference.segment_sums`); exclusive sums are inclusive ones moved by one token, never ``p - a``, so the
    nearest shifted pair keeps decay 1 exactly."""
    a = _chunks(dt * A.to(dt.dtype), q)                                             # (b, c, Q, h)
    Q = a.shape[2]
    below = torch.ones(Q, Q, dtype=torch.bool, device=a.device).tril(-1)[:, :, None]  # k > j, (Q_k, Q_j, 1)
    pair = torch.where(below, a[:, :, :, None, :], _zero(a)).cumsum(2)             # (b, c, Q_i, Q_j, h)
    prefix = a.cumsum(2)
    total = prefix[:, :, -1]
    suffix = _shift_left(a.flip(2).cumsum(2).flip(2), 2)
    if shift:
        pair, prefix = _shift_right(pair, 2), _shift_right(prefix, 2)
    return ChunkDecays(pair=pair, prefix=prefix, suffix=suffix, total=total)


def chunk_states(x: Tensor, B: Tensor, dt: Tensor, suffix: Tensor, same_as_last: Tensor | None) -> Tensor:
    """Each chunk's own state ``S_c = sum_j exp(s_j) dt_j B_j x_j^T``: x (b, c, Q, h, P), B (b, c, Q, g, N),
    dt and the suffix sums ``s`` (b, c, Q, h) -> (b, c, h, P, N). ``same_as_last`` (b, c, Q): tokens in the segment
    of the chunk's last token (the others leave nothing)."""
    weight = torch.exp(suffix) * dt
    if same_as_last is not None:
        weight = torch.where(same_as_last[..., None], weight, _zero(weight))
    g = B.shape[3]
    xw = (x * weight[..., None]).unflatten(3, (g, -1))                                # (b, c, Q, g, r, P)
    return torch.einsum("bcjgn,bcjgrp->bcgrpn", B, xw).flatten(2, 3)


def state_passing(states: Tensor, log_carry: Tensor, carries: Tensor | None, initial: Tensor | None
                  ) -> tuple[Tensor, Tensor]:
    """The state entering each chunk and the state after the last one, of ``H_{c+1} = exp(log_carry_c) H_c + S_c``
    from ``H_0 = initial`` (zero when None). ``states`` (b, c, h, P, N); ``log_carry`` (b, c, h); ``carries``
    (b, c) bool or None: False where chunk c does not continue the segment of the state entering it (the state
    is then dropped, by selection). Returns (entering (b, c, h, P, N), final (b, h, P, N))."""
    decay = torch.exp(log_carry)[..., None, None].unbind(1)                          # c x (b, h, 1, 1)
    keeps = [None] * len(decay) if carries is None else carries[:, :, None, None, None].unbind(1)
    h = torch.zeros_like(states[:, 0]) if initial is None else initial.to(states.dtype)
    entering = []
    # unbind, not states[:, c]: its backward stacks the chunks' gradients once (an index's backward would build a
    # full-size gradient per chunk)
    for state, dc, keep in zip(states.unbind(1), decay, keeps):
        entering.append(h)
        kept = dc * h
        if keep is not None:
            kept = torch.where(keep, kept, _zero(kept))
        h = kept + state
    return torch.stack(entering, dim=1), h


def chunk_output(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, decays: ChunkDecays, shift: bool,
                 entering: Tensor | None, same: Tensor | None, reads_entering: Tensor | None) -> Tensor:
    """``y_i = sum_{j<=i} (C~_i . B_j) exp(S_ij) dt_j x_j + exp(q_i) C~_i . H_c`` per chunk (``j < i`` when
    ``shift``): x (b, c, Q, h, P), B and C~ (b, c, Q, g, N), dt (b, c, Q, h), ``decays`` the chunks' pair sums
    ``S`` and prefix sums ``q``; ``entering`` (b, c, h, P, N) or None (nothing enters); ``same`` (b, c, Q, Q) pairs
    in one segment, ``reads_entering`` (b, c, Q) rows in the segment of the entering state (None: all)."""
    Q, g = x.shape[2], B.shape[3]
    idx = torch.arange(Q, device=x.device)
    allowed = idx[:, None] > idx[None, :] if shift else idx[:, None] >= idx[None, :]      # (Q_i, Q_j)
    if same is not None:
        allowed = allowed & same
    allowed = allowed[..., None]                                                      # (…, Q_i, Q_j, 1)
    log_decay = decays.pair
    decay = torch.exp(torch.where(allowed, log_decay, torch.full((), float("-inf"), dtype=log_decay.dtype,
                                                                  device=log_decay.device)))
    cb = torch.einsum("bcign,bcjgn->bcijg", C, B)                                     # (b, c, Q, Q, g)
    weights = cb.repeat_interleave(x.shape[3] // g, dim=-1) * decay * dt[:, :, None, :, :]
    weights = torch.where(allowed, weights, _zero(weights))
    y = torch.einsum("bcijh,bcjhp->bcihp", weights, x)
    if entering is None:
        return y
    read = torch.einsum("bcign,bcgrpn->bcigrp", C, entering.unflatten(2, (g, -1))).flatten(3, 4)
    scale = torch.exp(decays.prefix)
    if reads_entering is not None:
        scale = torch.where(reads_entering[..., None], scale, _zero(scale))
    return y + read * scale[..., None]


def _one_direction(x: Tensor, d: Direction, seq_idx: Tensor | None, initial: Tensor | None, shift: bool, Q: int,
                   want_final: bool) -> tuple[Tensor, Tensor | None]:
    """The forward (left to right) direction: y (b, l, h, P) and, when ``want_final``, the last state."""
    b, length, heads, _ = x.shape
    C = _shift_right(d.C, 1) if shift else d.C
    xc, Bc, Cc, dtc = (_chunks(t, Q) for t in (x, d.B, C, d.dt))
    decays = chunk_decays(d.dt, d.A, Q, shift)
    nchunks = xc.shape[1]
    same = same_as_last = carries = reads_entering = None
    if seq_idx is not None:
        seq = _chunks(seq_idx, Q)
        if seq.shape[1] * Q > length:  # pads continue the last segment
            seq = seq.flatten(1, 2)
            seq[:, length:] = seq_idx[:, -1:]
            seq = seq.unflatten(1, (nchunks, Q))
        before = torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], dim=1)                  # the token before each chunk
        same = seq[:, :, :, None] == seq[:, :, None, :]
        same_as_last = seq == seq[:, :, -1:]
        carries = seq[:, :, -1] == before
        reads_entering = seq == before[..., None]
    entering = final = None
    if nchunks > 1 or want_final:
        states = chunk_states(xc, Bc, dtc, decays.suffix, same_as_last)
        entering, final = state_passing(states, decays.total, carries, initial)
    if nchunks == 1:  # one chunk: nothing enters it but the initial state
        entering = None if initial is None else initial[:, None].to(x.dtype)
    y = chunk_output(xc, Bc, Cc, dtc, decays, shift, entering, same, reads_entering)
    return y.flatten(1, 2)[:, :length], final


def scan_chunked(x: Tensor, forward: Direction | None, backward: Direction | None = None, *,
                 diag: Tensor | None = None, seq_idx: Tensor | None = None, initial_state: Tensor | None = None,
                 shift: bool = False, chunk_size: int = 64,
                 return_final_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The chunked scan of ``x`` (b, l, h, p) with the ``forward`` and/or ``backward`` direction (step sizes
    prepared, ``seq_idx`` normalised); the same result as :func:`.reference.reference_scan` up to rounding.

    Returns y (b, l, h, p), and the forward direction's state after the last token (b, h, p, n) when
    ``return_final_state``."""
    _, length, heads, head_dim = x.shape
    state = (forward or backward).B.shape[-1]  # type: ignore[union-attr]
    Q = chunk_length(length, chunk_size, heads, head_dim, state)
    y = final = None
    if forward is not None:
        y, final = _one_direction(x, forward, seq_idx, initial_state, shift, Q, return_final_state)
    if backward is not None:
        d = backward
        flipped = Direction(dt=d.dt.flip(1), A=d.A, B=d.B.flip(1), C=d.C.flip(1))
        seq = None if seq_idx is None else seq_idx.flip(1)
        y_b = _one_direction(x.flip(1), flipped, seq, None, shift, Q, False)[0].flip(1)
        y = y_b if y is None else y + y_b
    assert y is not None, "a scan needs at least one direction"
    if diag is not None:
        y = y + diag[..., None].to(y.dtype) * x
    if not return_final_state:
        return y
    if final is None:
        raise ValueError("the final state belongs to the forward direction, which is absent")
    return y, final
