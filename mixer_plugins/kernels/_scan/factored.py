"""The chunked scan with **factored decays**: every product a matmul over all heads of a group at once.

Within one chunk the decay between query i and key j is ``exp(q_i - p_j)`` (forward direction; see
:mod:`.chunked` for the notation). It factors as ``u_i * v_j`` with ``u_i = exp(q_i - m)`` and
``v_j = exp(m - p_j)`` around a centre ``m`` per chunk and head. So one direction's intra-chunk part, its state
read-out and its chunk states become, per chunk and group (``W = v * dt * x``, all heads of the group side by
side, ``T = mask(C~ B^T)``):

* ``y += u * (T W + C~ (e^m H))`` — the intra-chunk product and the read-out of the entering state;
* ``S = e^m (B^T W)`` — the chunk's own state (``e^{p_last - m} = e^m`` with ``m = p_last / 2``).

No per-head Q x Q block is ever built: the only Q x Q matrix is ``C~ B^T``, shared by the group's heads, and the
per-head work is three scalings of x-sized tensors. The states between chunks use the same recurrence as
:mod:`.chunked` (:func:`.chunked.state_recurrence`), in the layout the products want.

With ``m = p_last / 2`` both factors lie in ``[e^{m}, e^{-m}]``: they are bounded by ``e^{|p_last| / 2}`` (the
chunk's whole decay, halved). :func:`scan_factored` takes this path only where that bound is safe for the dtype
(:data:`MAX_HALF_RANGE`), every input is finite (a non-finite token must not reach the tokens it cannot see,
which a product ``0 * inf`` would break) and there is no ``seq_idx``; it returns None otherwise and the caller
runs :func:`.chunked.scan_chunked`, the general path. Both give the result of :func:`.reference.reference_scan`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._tiling import tile_bounds, tile_length
from .chunked import TILE_ELEMENTS, _known_finite, _pad_time, chunk_length, state_recurrence
from .inputs import ScanInputs

__all__ = ["MAX_HALF_RANGE", "scan_factored"]

#: Largest ``|m| = |p_last| / 2`` (natural log units) the factored path accepts, per dtype: its factors stay
#: below ``e^{|m|}``. float32 and bfloat16 keep ``e^40 ~ 2e17`` of their ``3e38`` range for the values, float64
#: ``e^300`` of ``1e308``. float16 (range 6.5e4) always takes the general path.
MAX_HALF_RANGE = {torch.float32: 40.0, torch.bfloat16: 40.0, torch.float64: 300.0}


def _by_chunk(t: Tensor, pad: int, q: int) -> Tensor:
    """(b, l, ...) -> (b, c, q, ...), zero-padded along time to whole chunks."""
    t = _pad_time(t, pad)
    return t.reshape(t.shape[0], t.shape[1] // q, q, *t.shape[2:])


class _Direction:
    """One direction's per-chunk factors, for the whole sequence (small: (b, c, Q, h) or (b, c, g, Q, n)).

    ``u`` scales the outputs, ``v`` (with dt) the inputs, ``scale = e^m`` the states, ``log_carry = p_last`` is
    the log decay across a chunk; ``keys`` B and ``queries`` C~ (shifted) are laid out (b, c, g, Q, n)."""

    def __init__(self, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, reverse: bool, shift: bool, pad: int, q: int):
        dt_c = _by_chunk(dt, pad, q)                                                      # (b, c, Q, h)
        a = dt_c * A.to(dt.dtype)
        p = a.cumsum(2)
        e = p - a
        last = p[:, :, -1:]                                                               # (b, c, 1, h)
        m = last * 0.5
        self.half_range = m
        if not reverse:   # lower: exp(q_i - p_j), q = e (shifted) or p
            query = e if shift else p
            self.u = torch.exp(query - m)
            self.v = torch.exp(m - p) * dt_c
        else:             # upper: exp(e_j - q_i), q = p (shifted) or e
            query = p if shift else e
            self.u = torch.exp(m - query)
            self.v = torch.exp(e - m) * dt_c
        self.scale = torch.exp(m)                                                         # (b, c, 1, h)
        self.log_carry = last[:, :, 0]                                                    # (b, c, h)
        self.keys = _by_chunk(B, pad, q).transpose(2, 3)                                  # (b, c, g, Q, n)
        self.queries = _by_chunk(C, pad, q).transpose(2, 3)


def scan_factored(inputs: ScanInputs, *, return_final_state: bool = False,
                  tile_size: int | None = None) -> Tensor | tuple[Tensor, Tensor] | None:
    """The chunked scan of ``inputs`` with factored decays, or None where this path does not apply (see the
    module docstring): then :func:`.chunked.scan_chunked` gives the result. Same returns as that function."""
    x, fwd_dir, bwd_dir, diag = inputs.x, inputs.forward, inputs.backward, inputs.diag
    if inputs.seq_idx is not None or (fwd_dir is None and bwd_dir is None) or x.numel() == 0:
        return None
    dtype = x.dtype
    limit = MAX_HALF_RANGE.get(dtype)
    if limit is None:
        return None
    dirs = [d for d in (fwd_dir, bwd_dir) if d is not None]
    tensors = [x] + [t for d in dirs for t in (d.dt, d.B, d.C)] + ([] if diag is None else [diag])
    if inputs.initial_state is not None:
        tensors.append(inputs.initial_state)
    if not _known_finite(*tensors):
        return None
    bsz, length, heads, hdim = x.shape
    groups, nstate = dirs[0].B.shape[2:]
    rep = heads // groups
    directions = len(dirs)
    Q = chunk_length(length, inputs.chunk_size, heads, hdim, groups, nstate, directions)
    nchunks = -(-length // Q)
    pad = nchunks * Q - length
    shift = inputs.shift

    def shifted(C: Tensor, reverse: bool) -> Tensor:
        if not shift:
            return C
        if reverse:
            return torch.cat([C[:, 1:], torch.zeros_like(C[:, :1])], dim=1)
        return torch.cat([torch.zeros_like(C[:, :1]), C[:, :-1]], dim=1)

    fwd = None if fwd_dir is None else _Direction(fwd_dir.dt, fwd_dir.A, fwd_dir.B, shifted(fwd_dir.C, False),
                                                  reverse=False, shift=shift, pad=pad, q=Q)
    bwd = None if bwd_dir is None else _Direction(bwd_dir.dt, bwd_dir.A, bwd_dir.B, shifted(bwd_dir.C, True),
                                                  reverse=True, shift=shift, pad=pad, q=Q)
    for d in (fwd, bwd):
        if d is not None and bool(d.half_range.abs().amax() > limit):
            return None

    per_tile = int(tile_size) if tile_size is not None else tile_length(TILE_ELEMENTS, bsz * Q * heads * hdim)
    tiles = tile_bounds(nchunks, per_tile)
    x_c = _by_chunk(x, pad, Q)                                                            # (b, c, Q, h, p)
    diag_c = None if diag is None else _by_chunk(diag, pad, Q)                            # (b, c, Q, h)

    def split(t: Tensor | None) -> list[Tensor | None]:
        if t is None:
            return [None] * len(tiles)
        return [t] if len(tiles) == 1 else list(t.split(per_tile, dim=1))

    def parts(d: _Direction | None) -> list[list[Tensor | None]]:
        if d is None:
            return [[None] * len(tiles)] * 6
        return [split(t) for t in (d.u, d.v, d.scale, d.log_carry, d.keys, d.queries)]

    x_s, diag_s = split(x_c), split(diag_c)
    fwd_s, bwd_s = parts(fwd), parts(bwd)
    single = nchunks == 1

    def grouped(t: Tensor) -> Tensor:
        """(b, c, Q, h, p) -> (b, c, g, Q, r*p): the operand of the group's products (a view for one group)."""
        b, c = t.shape[:2]
        t = t.reshape(b, c, Q, groups, rep * hdim)
        return t.transpose(2, 3) if groups > 1 else t.view(b, c, 1, Q, rep * hdim)

    def heads_last(t: Tensor) -> Tensor:
        """(b, c, g, Q, r*p) -> (b, c, Q, h, p)."""
        b, c = t.shape[:2]
        if groups > 1:
            t = t.transpose(2, 3)
        return t.reshape(b, c, Q, heads, hdim)

    def per_head(t: Tensor) -> Tensor:
        """(b, c, Q', h) -> (b, c, Q', h, 1): a factor that scales every head's p columns."""
        return t[..., None]

    def state_scale(scale: Tensor) -> Tensor:
        """(b, c, 1, h) -> (b, c, g, 1, r, 1): e^m in the states' layout."""
        b, c = scale.shape[:2]
        return scale.reshape(b, c, groups, 1, rep, 1)

    def chunk_states(W: Tensor, keys: Tensor, scale: Tensor) -> Tensor:
        """e^m B^T W: (b, c, g, n, r, p)."""
        b, c = W.shape[:2]
        s = torch.matmul(keys.transpose(-1, -2), grouped(W))                             # (b, c, g, n, r*p)
        return s.view(b, c, groups, nstate, rep, hdim) * state_scale(scale).to(s.dtype)

    def run_states(states: Tensor, log_carry: Tensor, init: Tensor | None, reverse: bool):
        b, c = states.shape[:2]
        return state_recurrence(states, log_carry.reshape(b, c, groups, 1, rep, 1), init, reverse)

    def product(W: Tensor, keys: Tensor, queries: Tensor, u: Tensor, scale: Tensor,
                entering: Tensor | None, lower: bool) -> Tensor:
        """u * (mask(C~ B^T) W + C~ (e^m H)) in (b, c, Q, h, p)."""
        b, c = W.shape[:2]
        t = torch.matmul(queries, keys.transpose(-1, -2))                                # (b, c, g, Q, Q)
        t = t.tril_(-1 if shift else 0) if lower else t.triu_(1 if shift else 0)
        z = torch.matmul(t, grouped(W))                                                   # (b, c, g, Q, r*p)
        if entering is not None:
            scaled = (entering * state_scale(scale)).view(b, c, groups, nstate, rep * hdim)
            # out of place: an in-place product on a view of z would make autograd rebuild z's whole storage
            # in the backward (CopySlices: a fresh z-sized tensor and two copies)
            z = torch.baddbmm(z.view(b * c * groups, Q, rep * hdim), queries.reshape(b * c * groups, Q, nstate),
                              scaled.view(b * c * groups, nstate, rep * hdim)).view(b, c, groups, Q, rep * hdim)
        return heads_last(z) * per_head(u)

    # ------------------------------------------------ sweep 1, right to left: the backward direction's states
    from_right: list[Tensor | None] = [None] * len(tiles)
    W_b: list[Tensor | None] = [None] * len(tiles)
    if bwd is not None:
        u_s, v_s, scale_s, log_s, keys_s, _ = bwd_s
        carry = None
        for s in reversed(range(len(tiles))):
            W = x_s[s] * per_head(v_s[s]).to(dtype)
            W_b[s] = W
            if single:
                continue
            states = chunk_states(W, keys_s[s], scale_s[s])
            entering, carry = run_states(states, log_s[s], carry, True)
            from_right[s] = entering

    # ------------------------------------------------ sweep 2, left to right: everything else
    outputs: list[Tensor] = []
    init = inputs.initial_state
    carry = None if init is None else init.to(dtype).view(bsz, groups, rep, hdim, nstate).permute(0, 1, 4, 2, 3)
    for s in range(len(tiles)):
        y = None
        if fwd is not None:
            u_s, v_s, scale_s, log_s, keys_s, queries_s = fwd_s
            W = x_s[s] * per_head(v_s[s]).to(dtype)
            entering = None
            if not (single and init is None and not return_final_state):
                states = chunk_states(W, keys_s[s], scale_s[s])
                entering, carry = run_states(states, log_s[s], carry, False)
            y = product(W, keys_s[s], queries_s[s], u_s[s].to(dtype), scale_s[s].to(dtype), entering, True)
        if bwd is not None:
            u_s, v_s, scale_s, log_s, keys_s, queries_s = bwd_s
            upper = product(W_b[s], keys_s[s], queries_s[s], u_s[s].to(dtype), scale_s[s].to(dtype),
                            from_right[s], False)
            W_b[s] = from_right[s] = None
            y = upper if y is None else y.add_(upper)
        if diag_s[s] is not None:
            y = y.addcmul_(x_s[s], per_head(diag_s[s]).to(dtype))
        outputs.append(y)

    y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    y = y.reshape(bsz, nchunks * Q, heads, hdim)[:, :length]
    if return_final_state:
        if fwd is None or carry is None:
            raise ValueError("the final state belongs to the forward direction, which is absent")
        final = carry.permute(0, 1, 3, 4, 2).reshape(bsz, heads, hdim, nstate)
        return y, final
    return y
