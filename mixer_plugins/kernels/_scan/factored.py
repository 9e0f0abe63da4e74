"""The chunked scan with **factored decays**: every product a matmul over all heads of a group at once.

Within one chunk the decay between query i and key j is ``exp(q_i - p_j)`` (forward direction; see
:mod:`.chunked` for the notation). It factors as ``u_i * v_j`` with ``u_i = exp(q_i - m)`` and
``v_j = exp(m - p_j)`` around a centre ``m`` per chunk and head. So one direction's intra-chunk part, its state
read-out and its chunk states become, per chunk and group (``W = v * dt * x``, all heads of the group side by
side, ``T = mask(C~ B^T)``):

* ``y += u * (T W + C~ (e^m H))`` — the intra-chunk product and the read-out of the entering state;
* ``S = e^m (B^T W)`` — the chunk's own state (``e^{p_last - m} = e^m`` with ``m = p_last / 2``).

No per-head Q x Q block is ever built: the only Q x Q matrix is ``C~ B^T``, shared by the group's heads, and the
per-head work is three scalings of x-sized tensors. The states never carry the factor ``e^m`` as a pass of its own:
with ``S' = B^T W`` and ``K_c = e^{m_c} H_c`` (the read-out's operand), ``H_{c+1} = e^{2 m_c} H_c + e^{m_c} S'_c``
becomes ``K_{c+1} = e^{m_c + m_{c+1}} (K_c + S'_c)`` (:func:`scaled_state_recurrence`, one fused multiply-add per
chunk, a written-out backward).

With ``m = p_last / 2`` both factors lie in ``[e^{m}, e^{-m}]``: they are bounded by ``e^{|p_last| / 2}`` (the
chunk's whole decay, halved). :func:`scan_factored` takes this path only where that bound is safe for the dtype
(:data:`MAX_HALF_RANGE`), every input is finite (a non-finite token must not reach the tokens it cannot see,
which a product ``0 * inf`` would break) and there is no ``seq_idx``; it returns None otherwise and the caller
runs :func:`.chunked.scan_chunked`, the general path. Both give the result of :func:`.reference.reference_scan`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._tiling import tile_bounds, tile_length
from .chunked import TILE_ELEMENTS, _known_finite, _one_thread, _pad_time, chunk_length
from .inputs import ScanInputs

__all__ = ["MAX_HALF_RANGE", "scan_factored", "scaled_state_recurrence"]

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

    ``u`` scales the outputs, ``v`` (with dt) the inputs, ``half_range = m = p_last / 2`` (b, c, 1, h) gives the
    states' factors (``e^m``, and ``e^{2m}`` across a chunk); ``keys`` B and ``queries`` C~ (shifted) are laid out
    (b, c, g, Q, n)."""

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
        self.keys = _by_chunk(B, pad, q).transpose(2, 3)                                  # (b, c, g, Q, n)
        self.queries = _by_chunk(C, pad, q).transpose(2, 3)


def scaled_state_recurrence(states: Tensor, half_log: Tensor, init: Tensor | None,
                            reverse: bool) -> tuple[Tensor | None, Tensor]:
    """The states between chunks, kept scaled for the read-out: ``K_c = e^{m_c} H_c``.

    ``H`` follows ``H_{c+1} = e^{2 m_c} H_c + e^{m_c} S'_c`` from ``H = init`` (zero when None), right to left when
    ``reverse``; then ``K_{c+1} = e^{m_c + m_{c+1}} (K_c + S'_c)``. ``states`` S' (b, C, ...) in any layout,
    ``half_log`` m broadcastable to them ((b, C, g, 1, r, 1) for states (b, C, g, n, r, p)), ``init`` (b, ...).
    Returns K for every chunk (None when nothing enters: one chunk and no ``init``) and the state H after the
    last chunk (after the first one when ``reverse``). One chunk is plain autograd; more run
    :class:`_ScaledStatePass` (one fused multiply-add per chunk, a written-out backward)."""
    if states.shape[1] == 1:
        scale = torch.exp(half_log[:, 0]).to(states.dtype)
        if init is None:
            return None, states[:, 0] * scale
        entering = init * scale
        return entering[:, None], (entering + states[:, 0]) * scale
    return _ScaledStatePass.apply(states, half_log, init, reverse)


class _ScaledStatePass(torch.autograd.Function):
    """:func:`scaled_state_recurrence` over more than one chunk.

    With ``link_c = e^{m_c + m_{c+1}}`` (between chunks c and c+1), left to right: ``K_0 = e^{m_0} init``,
    ``K_{c+1} = link_c (K_c + S'_c)``, final ``H = e^{m_last} (K_last + S'_last)``; right to left the same with the
    indices mirrored. The forward writes ``link_c S'_c`` into K's slots in one batched product, then adds
    ``link_c K_c`` chunk by chunk (one ``addcmul_`` per chunk, on one thread: a chunk's state is small).

    Backward, with ``G_c`` the whole gradient reaching ``K_c``: ``G_c = dK_c + link_c G_{c+1}`` (and
    ``e^{m_last} dH`` added to ``G_last``), ``dS'_c = link_c G_{c+1}`` (``e^{m_last} dH`` for the last; formed
    directly, as ``G_c - dK_c`` would cancel), ``d init = e^{m_0} G_0``; every ``K_c`` and the final state are
    proportional to the ``e^m`` of the chunks they name, so with ``r_c = <G_c, K_c>``,
    ``dm_c = r_c + r_{c+1}`` (``+ <dH, H>`` for the last chunk)."""

    @staticmethod
    def forward(ctx, states: Tensor, half_log: Tensor, init: Tensor | None, reverse: bool):
        nchunks = states.shape[1]
        scale = torch.exp(half_log).to(states.dtype)                                      # e^{m_c}
        link = scale[:, :-1] * scale[:, 1:]                                                 # e^{m_c + m_{c+1}}
        entering = torch.empty_like(states)
        first, last = (nchunks - 1, 0) if reverse else (0, nchunks - 1)
        if reverse:   # K_c = link_c (K_{c+1} + S'_{c+1})
            torch.mul(states[:, 1:], link, out=entering[:, :-1])
        else:         # K_{c+1} = link_c (K_c + S'_c)
            torch.mul(states[:, :-1], link, out=entering[:, 1:])
        ent, links = entering.unbind(1), link.unbind(1)
        if init is None:
            ent[first].zero_()
        else:
            torch.mul(init, scale[:, first], out=ent[first])
        with _one_thread(states.device):
            if reverse:
                for c in range(nchunks - 2, -1, -1):
                    ent[c].addcmul_(links[c], ent[c + 1])
            else:
                for c in range(1, nchunks):
                    ent[c].addcmul_(links[c - 1], ent[c - 1])
        carry = (ent[last] + states[:, last]).mul_(scale[:, last])
        ctx.save_for_backward(scale, link, entering, carry)
        ctx.reverse, ctx.has_init, ctx.log_dtype = reverse, init is not None, half_log.dtype
        return entering, carry

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_entering: Tensor | None, grad_carry: Tensor | None):
        scale, link, entering, carry = ctx.saved_tensors
        nchunks, reverse = entering.shape[1], ctx.reverse
        first, last = (nchunks - 1, 0) if reverse else (0, nchunks - 1)
        total = torch.zeros_like(entering) if grad_entering is None else grad_entering.clone()   # G
        if grad_carry is not None:
            total[:, last].addcmul_(grad_carry, scale[:, last])
        acc, links = total.unbind(1), link.unbind(1)
        with _one_thread(entering.device):
            if reverse:
                for c in range(1, nchunks):
                    acc[c].addcmul_(links[c - 1], acc[c - 1])
            else:
                for c in range(nchunks - 2, -1, -1):
                    acc[c].addcmul_(links[c], acc[c + 1])
        # dS'_c: what reaches K_c + S'_c, formed directly (G_c - dK_c would cancel where the link is tiny)
        grad_states = torch.empty_like(entering)
        if reverse:   # K_{c-1} = link_{c-1} (K_c + S'_c); the final state reads K_0 + S'_0
            torch.mul(total[:, :-1], link, out=grad_states[:, 1:])
        else:         # K_{c+1} = link_c (K_c + S'_c); the final state reads the last chunk's
            torch.mul(total[:, 1:], link, out=grad_states[:, :-1])
        if grad_carry is None:
            grad_states[:, last].zero_()
        else:
            torch.mul(grad_carry, scale[:, last], out=grad_states[:, last])
        grad_log = None
        if ctx.needs_input_grad[1]:
            shares = (total * entering).sum_to_size(scale.shape)                            # r_c
            grad_log = shares.clone()
            if reverse:
                grad_log[:, 1:] += shares[:, :-1]
            else:
                grad_log[:, :-1] += shares[:, 1:]
            if grad_carry is not None:
                grad_log[:, last] += (grad_carry * carry).sum_to_size(scale[:, last].shape)
            grad_log = grad_log.to(ctx.log_dtype)
        grad_init = None
        if ctx.has_init and ctx.needs_input_grad[2]:
            grad_init = acc[first] * scale[:, first]
        return grad_states, grad_log, grad_init, None


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
            return [[None] * len(tiles)] * 5
        return [split(t) for t in (d.u, d.v, d.half_range, d.keys, d.queries)]

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

    def chunk_states(W: Tensor, keys: Tensor) -> Tensor:
        """B^T W (the chunk's state without its factor e^m): (b, c, g, n, r, p)."""
        b, c = W.shape[:2]
        s = torch.matmul(keys.transpose(-1, -2), grouped(W))                             # (b, c, g, n, r*p)
        return s.view(b, c, groups, nstate, rep, hdim)

    def run_states(states: Tensor, half_range: Tensor, init: Tensor | None, reverse: bool):
        """(e^m H entering each chunk or None, the state H after the tile)."""
        b, c = states.shape[:2]
        return scaled_state_recurrence(states, half_range.reshape(b, c, groups, 1, rep, 1), init, reverse)

    def product(W: Tensor, keys: Tensor, queries: Tensor, u: Tensor, entering: Tensor | None,
                lower: bool) -> Tensor:
        """u * (mask(C~ B^T) W + C~ K) in (b, c, Q, h, p), with ``entering`` K = e^m H."""
        b, c = W.shape[:2]
        t = torch.matmul(queries, keys.transpose(-1, -2))                                # (b, c, g, Q, Q)
        t = t.tril_(-1 if shift else 0) if lower else t.triu_(1 if shift else 0)
        z = torch.matmul(t, grouped(W))                                                   # (b, c, g, Q, r*p)
        if entering is not None:
            # out of place: an in-place product on a view of z would make autograd rebuild z's whole storage
            # in the backward (CopySlices: a fresh z-sized tensor and two copies)
            z = torch.baddbmm(z.view(b * c * groups, Q, rep * hdim), queries.reshape(b * c * groups, Q, nstate),
                              entering.reshape(b * c * groups, nstate, rep * hdim)).view(b, c, groups, Q, rep * hdim)
        return heads_last(z) * per_head(u)

    # ------------------------------------------------ sweep 1, right to left: the backward direction's states
    from_right: list[Tensor | None] = [None] * len(tiles)
    W_b: list[Tensor | None] = [None] * len(tiles)
    if bwd is not None:
        u_s, v_s, half_s, keys_s, _ = bwd_s
        carry = None
        for s in reversed(range(len(tiles))):
            W = x_s[s] * per_head(v_s[s]).to(dtype)
            W_b[s] = W
            if single:
                continue
            states = chunk_states(W, keys_s[s])
            entering, carry = run_states(states, half_s[s], carry, True)
            from_right[s] = entering

    # ------------------------------------------------ sweep 2, left to right: everything else
    outputs: list[Tensor] = []
    init = inputs.initial_state
    carry = None if init is None else init.to(dtype).view(bsz, groups, rep, hdim, nstate).permute(0, 1, 4, 2, 3)
    for s in range(len(tiles)):
        y = None
        if fwd is not None:
            u_s, v_s, half_s, keys_s, queries_s = fwd_s
            W = x_s[s] * per_head(v_s[s]).to(dtype)
            entering = None
            if not (single and init is None and not return_final_state):
                states = chunk_states(W, keys_s[s])
                entering, carry = run_states(states, half_s[s], carry, False)
            y = product(W, keys_s[s], queries_s[s], u_s[s].to(dtype), entering, True)
        if bwd is not None:
            u_s, v_s, half_s, keys_s, queries_s = bwd_s
            upper = product(W_b[s], keys_s[s], queries_s[s], u_s[s].to(dtype), from_right[s], False)
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
