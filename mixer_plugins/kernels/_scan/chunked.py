"""Chunked scans in pure PyTorch: the SSD algorithm, extended to both directions in one pass.

The ``torch`` backend of the scan ops: O(L) memory (no L x L tensor), any length, CPU or GPU. This is the general
path; where its conditions hold (finite inputs, no ``seq_idx``, a decay range the dtype can carry) the backend runs
:mod:`.factored` instead, the same algorithm with each chunk's decays factored (see :func:`.custom_op._scan`).

The sequence is cut into chunks of Q tokens (:func:`chunk_length`: at most ``chunk_size``, balanced so that
little is padded). Within a chunk, the forward (lower), backward (upper) and
diagonal parts of the quasiseparable matrix are summed into **one** Q x Q block per head and applied with
one batched matmul. Between chunks, each direction carries an (p x n) state per head: the forward state
flows left to right, the backward state right to left. So the two directions of Hydra cost one
intra-chunk product plus two light state passes, with no flipped copies of the input and no doubled
batch (what the released Hydra code does).

All formulas are in :mod:`.reference` (the oracle). With ``a = A * dt``, chunk-local cumsums
``p`` (inclusive) and ``e = p - a`` (exclusive):

* forward, query i in chunk c reads ``C~_i exp(q_i) H_c`` with ``H_c`` the state after chunk c-1;
  ``q = e`` when shifted (the state *before* token i), ``q = p`` otherwise; ``C~ = C`` shifted by one;
* backward, query i reads ``C~_i exp(p_last - q_i) G_c`` with ``G_c`` the backward state entering chunk c
  from the right; ``q = p`` when shifted, ``e`` otherwise;
* states: ``H_{c+1} = exp(p_last) H_c + sum_j exp(p_last - p_j) dt_j B_j x_j^T`` and
  ``G_{c-1} = exp(p_last) G_c + sum_j exp(e_j) dt_j B_j x_j^T``.

``seq_idx`` (packed sequences) masks pairs across segments inside a chunk and gates the states
between chunks, so neither direction, nor the shift, crosses a segment boundary.
Its ids arrive normalised by the public op (:func:`.inputs.normalize_seq_idx`): equal ids <=> same segment.

The chunks are walked a tile at a time (:data:`TILE_ELEMENTS` elements of temporaries per tile), in two
sweeps: right to left for the backward direction's states, then left to right for everything else.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .._threads import threads_for
from .._tiling import tile_bounds, tile_length
from .inputs import ScanInputs

__all__ = ["AUTO_CHUNK_MIN_STATE", "TILE_ELEMENTS", "chunk_length", "scan_chunked", "tile_chunks", "tile_elements"]


def _pad_time(t: Tensor | None, pad: int) -> Tensor | None:
    """Zeros appended along dim 1 (time). (A concatenation: ``F.pad`` would first fill the whole result with zeros,
    then copy the input over it.)"""
    if t is None or pad == 0:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], dim=1)


def _chunks(t: Tensor | None, q: int) -> Tensor | None:
    """(b, l, ...) -> (b, c, q, ...)."""
    if t is None:
        return None
    return t.reshape(t.shape[0], t.shape[1] // q, q, *t.shape[2:])


TILE_ELEMENTS = 1 << 21  # target size of one tile's temporaries (elements): 8 MiB in float32


def tile_chunks(bsz: int, chunk: int, heads: int, width: int) -> int:
    """Chunks per tile: the tile's largest temporaries, (batch, chunk, heads, width) per chunk, stay near
    :data:`TILE_ELEMENTS` elements, so they live in cache and in malloc's reused heap (see :mod:`.._tiling`)."""
    return tile_length(TILE_ELEMENTS, bsz * chunk * heads * width)


#: The chunk length is tuned (:func:`chunk_length`) only for scans whose per-token state, heads x head_dim x state,
#: holds at least this many elements: the sizes where it was measured. Smaller scans use ``chunk_size`` as given, so
#: that tests at small shapes exercise the chunk and tile boundaries they ask for.
AUTO_CHUNK_MIN_STATE = 4096


def chunk_length(length: int, chunk_size: int, heads: int, head_dim: int, groups: int, state: int,
                 directions: int) -> int:
    """Tokens per chunk that the scan actually uses for a sequence of ``length`` and the requested ``chunk_size``.

    It changes speed only, never the result (up to rounding). A sequence no longer than ``chunk_size`` is one
    chunk of ``length`` tokens (not padded to a chunk; it then needs no state work at all unless an initial or
    final state is involved). For scans of at least :data:`AUTO_CHUNK_MIN_STATE` state elements per token, longer
    sequences use **balanced** chunks: the fewest chunks of at most ``chunk_size`` tokens, all of equal length, so
    that little is padded (197 tokens at chunk 64: 4 chunks of 50, 200 tokens, not 256). Smaller scans use
    ``chunk_size`` as given. (One chunk for a longer sequence, the quadratic form, saves the states' FLOPs but was
    measured slower on CPU: its elementwise passes over the L x L blocks cost more; see docs/performance.md.)
    ``heads``, ``head_dim``, ``groups``, ``state`` and ``directions`` describe the scan (the gate above).
    """
    q = max(1, min(int(chunk_size), int(length)))
    if length <= q or heads * head_dim * state < AUTO_CHUNK_MIN_STATE:
        return q
    return -(-length // -(-length // q))


def _scan_shape(inputs: ScanInputs) -> tuple[int, int, int, int, int, int, int]:
    """(batch, length, heads, head_dim, groups, state, directions) of ``inputs``."""
    bsz, length, heads, hdim = inputs.x.shape
    direction = inputs.forward or inputs.backward
    groups, nstate = (0, 0) if direction is None else direction.B.shape[2:]
    return bsz, length, heads, hdim, groups, nstate, int(inputs.forward is not None) + int(inputs.backward is not None)


def tile_elements(inputs: ScanInputs) -> int:
    """Elements of the largest temporary of one tile of ``inputs``' scan (what :mod:`.._threads` sizes by)."""
    bsz, length, heads, hdim, groups, nstate, directions = _scan_shape(inputs)
    q = chunk_length(length, inputs.chunk_size, heads, hdim, groups, nstate, directions)
    width = max(hdim, q, nstate)
    nchunks = -(-length // q)
    return bsz * min(nchunks, tile_chunks(bsz, q, heads, width)) * q * heads * width


def scan_chunked(inputs: ScanInputs, *, return_final_state: bool = False, tile_size: int | None = None,
                 slab_size: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """The chunked scan of ``inputs``; the same result as :func:`.reference.reference_scan`.

    Returns y (b, l, h, p), and the forward direction's state after the last token (b, h, p, n) when
    ``return_final_state``. ``tile_size``: chunks per tile (default :func:`tile_chunks`); changes speed only,
    never the result. ``slab_size`` is its deprecated former name.
    """
    if slab_size is not None:
        warnings.warn("scan_chunked(slab_size=...) is deprecated; use tile_size=...", DeprecationWarning,
                      stacklevel=2)
        if tile_size is not None:
            raise ValueError("pass tile_size only (slab_size is its deprecated former name)")
        tile_size, size_name = slab_size, "slab_size"
    else:
        size_name = "tile_size"
    x, fwd_dir, bwd_dir, diag, seq_idx = inputs.x, inputs.forward, inputs.backward, inputs.diag, inputs.seq_idx
    shift = inputs.shift
    if fwd_dir is None and bwd_dir is None:
        raise ValueError("scan_chunked needs at least one direction")
    bsz, length, heads, hdim = x.shape
    groups, nstate = (fwd_dir or bwd_dir).B.shape[2:]
    if heads % groups:
        raise ValueError(f"number of heads ({heads}) must be a multiple of the number of groups ({groups})")
    rep = heads // groups
    # a sequence shorter than a chunk is one chunk, not padded to one; larger scans tune the length (chunk_length)
    directions = int(fwd_dir is not None) + int(bwd_dir is not None)
    Q = chunk_length(length, inputs.chunk_size, heads, hdim, groups, nstate, directions)
    nchunks = -(-length // Q)
    pad = nchunks * Q - length
    dtype = x.dtype
    per_tile = int(tile_size) if tile_size is not None else tile_chunks(bsz, Q, heads, max(hdim, Q, nstate))
    if per_tile < 1:
        raise ValueError(f"{size_name} must be positive, got {tile_size}")
    tiles = tile_bounds(nchunks, per_tile)

    # Shift the query-side C by one position (Hydra's shift) before padding, so it never reads a pad.
    C_f = C_b = None
    if fwd_dir is not None:
        C_f = fwd_dir.C if not shift else torch.cat([torch.zeros_like(fwd_dir.C[:, :1]), fwd_dir.C[:, :-1]], dim=1)
    if bwd_dir is not None:
        C_b = bwd_dir.C if not shift else torch.cat([bwd_dir.C[:, 1:], torch.zeros_like(bwd_dir.C[:, :1])], dim=1)

    x_c = _chunks(_pad_time(x, pad), Q).view(bsz, nchunks, Q, groups, rep, hdim)       # (b,c,Q,g,r,p)
    seq = before = after_first = after_last = None
    if seq_idx is not None:
        seq = _pad_time(seq_idx, pad)
        if pad:
            seq[:, length:] = seq_idx[:, -1:]
        seq = _chunks(seq, Q)                                                            # (b,c,Q)
        before = torch.cat([seq[:, :1, :1], seq[:, :-1, -1:]], dim=1)                    # seq before each chunk
        after_first = torch.cat([seq[:, 1:, :1], seq[:, -1:, :1]], dim=1)                # seq after each chunk
        # (for the backward read-out; nothing enters the last chunk from the right anyway)
        after_last = torch.cat([seq[:, 1:, :1], seq[:, -1:, -1:]], dim=1)

    idx = torch.arange(Q, device=x.device)

    def direction(dt: Tensor, A: Tensor, B: Tensor, C: Tensor):
        """Per-chunk log decays of one direction, for the whole sequence: (b, c, g, r, Q) each (small)."""
        # contiguous with Q last: these small tensors broadcast against Q x Q blocks along their last
        # dimension, and PyTorch's CPU kernels are several times slower when that operand is strided
        dt_c = _chunks(_pad_time(dt, pad), Q).view(bsz, nchunks, Q, groups, rep)          # (b,c,Q,g,r)
        dtp = dt_c.permute(0, 1, 3, 4, 2).contiguous()                                    # (b,c,g,r,Q)
        a = dtp * A.to(dt.dtype).view(groups, rep, 1)
        p = a.cumsum(-1)
        return p, p - a, dtp, _chunks(_pad_time(B, pad), Q), _chunks(_pad_time(C, pad), Q)

    # Every per-chunk tensor is split into its tiles once, up front: the backward of one split is one
    # concatenation, while the backward of each tile's slice would write a zero-filled gradient the size of
    # the whole sequence (quadratic in the number of tiles).
    def by_tile(t: Tensor | None) -> list[Tensor | None]:
        return [None] * len(tiles) if t is None else list(t.split(per_tile, dim=1))

    fwd = [by_tile(t) for t in direction(fwd_dir.dt, fwd_dir.A, fwd_dir.B, C_f)] if fwd_dir is not None else None
    bwd = [by_tile(t) for t in direction(bwd_dir.dt, bwd_dir.A, bwd_dir.B, C_b)] if bwd_dir is not None else None
    diag_s = by_tile(None if diag is None else _chunks(_pad_time(diag, pad), Q).view(bsz, nchunks, Q, groups, rep))
    x_s_all = by_tile(x_c)
    seq_s, before_s, after_first_s, after_last_s = (by_tile(t) for t in (seq, before, after_first, after_last))

    # ------------------------------------------------ sweep 1, right to left: the backward direction's states
    # The backward state of a tile needs every tile to its right, so its read-out is computed first, tile by
    # tile from the right, and kept (one tile-sized tensor each) until sweep 2 adds it in.
    from_right: list[Tensor | None] = [None] * len(tiles)
    # One chunk: nothing enters it from the right, and from the left only an initial state; the chunk's own state
    # is needed only for the final state. Then the state machinery is skipped (the quadratic form alone).
    single = nchunks == 1
    if bwd is not None and not single:
        carry = None
        for s in reversed(range(len(tiles))):
            p, e, dtp, B_c, C_c = (t[s] for t in bwd)
            sq = seq_s[s]
            from_start = torch.exp(e) * dtp                                                # exp(e_j) dt_j
            if sq is not None:
                from_start = from_start * (sq == sq[..., :1])[:, :, None, None, :]
            states = _chunk_states(from_start.to(dtype), B_c, x_s_all[s])
            log_carry = p[..., -1]
            if sq is not None:  # right to left: chunk c carries the state of chunk c+1 only within a segment
                log_carry = log_carry.masked_fill(~(sq[:, :, 0] == after_first_s[s][..., 0])[:, :, None, None],
                                                  float("-inf"))
            entering, carry = _scan_chunk_states(states, log_carry, carry, reverse=True)
            if entering is None:  # a one-chunk tile with nothing to its right
                if per_tile == 1:  # (every tile is one chunk: skipped, as the FLOP formula counts)
                    continue
                entering = torch.zeros_like(states)
            query = torch.exp(p[..., -1:] - (p if shift else e)).to(dtype)
            if sq is not None:
                query = query * (sq == after_last_s[s])[:, :, None, None, :]
            from_right[s] = _read_out(C_c, query, entering)

    # ------------------------------------------------ sweep 2, left to right: everything else, tile by tile
    outputs: list[Tensor] = []
    init = inputs.initial_state
    carry = None if init is None else init.to(dtype).view(bsz, groups, rep, hdim, nstate)
    final_state = None
    for s in range(len(tiles)):
        x_s = x_s_all[s]
        sq = seq_s[s]
        same = None if sq is None else (sq[..., :, None] == sq[..., None, :])[:, :, None, None]   # (b,c,1,1,Q,Q)
        terms: list[Tensor] = []
        block = None                                                                      # (b, c, g, r, Q, Q)
        if fwd is not None:
            p, e, dtp, B_c, C_c = (t[s] for t in fwd)
            q_log = e if shift else p
            # lower part: C~_i.B_j exp(q_i - p_j) dt_j for j < i (j <= i unshifted)
            allowed = (idx[:, None] > idx[None, :]) if shift else (idx[:, None] >= idx[None, :])
            block = _intra_block(C_c, B_c, q_log, -p, dtp, allowed if same is None else allowed & same)
        if fwd is not None and not (single and init is None and not return_final_state):
            # chunk states: sum_j exp(p_last - p_j) dt_j B_j x_j^T
            to_end = torch.exp(p[..., -1:] - p) * dtp                                     # (b,c,g,r,Q)
            if sq is not None:
                to_end = to_end * (sq == sq[..., -1:])[:, :, None, None, :]
            states = _chunk_states(to_end.to(dtype), B_c, x_s)
            log_carry = p[..., -1]                                                         # (b,c,g,r)
            if sq is not None:  # the state crosses into the next chunk only within a segment
                crosses = (sq[:, :, -1] == before_s[s][..., 0])[:, :, None, None]
                log_carry = log_carry.masked_fill(~crosses, float("-inf"))
            entering, carry = _scan_chunk_states(states, log_carry, carry)
            if entering is not None:  # None: a one-chunk tile with nothing to its left
                query = torch.exp(q_log).to(dtype)                                        # (b,c,g,r,Q)
                if sq is not None:
                    query = query * (sq == before_s[s])[:, :, None, None, :]
                terms.append(_read_out(C_c, query, entering))
        if bwd is not None:
            p, e, dtp, B_c, C_c = (t[s] for t in bwd)
            q_log = p if shift else e
            # upper part: C~_i.B_j exp(e_j - q_i) dt_j for j > i (j >= i unshifted)
            allowed = (idx[:, None] < idx[None, :]) if shift else (idx[:, None] <= idx[None, :])
            upper = _intra_block(C_c, B_c, -q_log, e, dtp, allowed if same is None else allowed & same)
            block = upper if block is None else block.add_(upper)  # in place: no product reads it back
            if from_right[s] is not None:
                terms.append(from_right[s])
            from_right[s] = None  # drop the reference: its memory is only the autograd graph's from now on
        if diag_s[s] is not None:
            terms.append(diag_s[s][..., None].to(dtype) * x_s)
        y = torch.einsum("bcgrij,bcjgrp->bcigrp", block.to(dtype), x_s)
        for term in terms:  # in place: the product's backward never reads its own result
            y = y.add_(term)
        outputs.append(y)
    if fwd is not None and carry is not None:
        final_state = carry.reshape(bsz, heads, hdim, nstate)

    y = (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1))
    y = y.reshape(bsz, nchunks * Q, heads, hdim)[:, :length]
    if return_final_state:
        if final_state is None:
            raise ValueError("the final state belongs to the forward direction, which is absent")
        return y, final_state
    return y


def _known_finite(*tensors: Tensor) -> bool:
    """True when every tensor is a plain (eager, untraced) tensor whose values are all finite: then the selections
    that guard against non-finite values can be skipped. False, the safe path, whenever values cannot be read
    (fake or functional tensors, a dispatch mode, ``torch.compile``) or one is non-finite.

    One pass per tensor: the sum of finite values is finite unless it overflows, and any NaN or infinity makes it
    non-finite; an overflowing sum only sends a finite tensor down the safe path (never the reverse)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if any(type(t) is not torch.Tensor for t in tensors):
        return False
    return all(bool(torch.isfinite(t.detach().sum())) for t in tensors)


def _intra_block(C: Tensor, B: Tensor, row: Tensor, col: Tensor, dt: Tensor, allowed: Tensor) -> Tensor:
    """One direction's part of the intra-chunk matrix, ``C_i.B_j exp(row_i + col_j) dt_j`` where ``allowed``:
    C, B (b,c,Q,g,n); row, col, dt (b,c,g,r,Q); allowed (Q, Q) or (b,c,1,1,Q,Q) -> (b,c,g,r,Q,Q)."""
    cb = torch.einsum("bcign,bcjgn->bcgij", C, B)                                          # (b,c,g,Q,Q)
    # Excluded pairs have weight exactly 0, so their product is 0 unless C.B or dt is non-finite (a huge or
    # non-finite B_j or dt_j of an excluded, e.g. future, token: 0 * inf = NaN). Only then are they dropped by
    # selection (a full-size copy, and one more in the backward), under plain autograd; the usual all-finite case
    # runs :class:`_IntraWeights`, whose backward is written out (fewer passes over the Q x Q blocks).
    if _known_finite(cb, dt):
        return _IntraWeights.apply(cb, row, col, dt, allowed)
    w = torch.exp((row[..., :, None] + col[..., None, :]).masked_fill(~allowed, float("-inf")))
    return (cb[:, :, :, None] * w * dt[..., None, :]).masked_fill(~allowed, 0.0)


class _IntraWeights(torch.autograd.Function):
    """``cb_ij exp(row_i + col_j) dt_j`` where ``allowed`` (else 0), for finite ``cb`` and ``dt``, with its
    gradients written out: with ``E = grad * out``, ``d row_i = sum_j E_ij``, ``d col_j = sum_i E_ij``,
    ``d dt_j = sum_i grad_ij cb_ij w_ij`` and ``d cb_ij = sum_heads grad_ij w_ij dt_j``. The excluded pairs enter
    as an additive ``-inf`` bias (cheaper than a selection) and keep weight 0; a non-finite incoming gradient is
    zeroed there first, so it reaches only the pairs that exist. Saves ``w`` only (autograd kept two blocks)."""

    @staticmethod
    def forward(ctx, cb: Tensor, row: Tensor, col: Tensor, dt: Tensor, allowed: Tensor) -> Tensor:
        bias = torch.zeros(allowed.shape, dtype=row.dtype, device=row.device).masked_fill_(~allowed, float("-inf"))
        w = (row[..., :, None] + bias).add_(col[..., None, :]).exp_()                        # (b,c,g,r,Q,Q)
        out = w * cb[:, :, :, None]
        out.mul_(dt[..., None, :])
        ctx.save_for_backward(cb, dt, w, allowed)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        cb, dt, w, allowed = ctx.saved_tensors
        if not bool(torch.isfinite(grad.sum())):
            grad = grad.masked_fill(~allowed, 0.0)
        t = grad * w                                                                           # grad_ij w_ij
        need_cb, need_row, need_col, need_dt, _ = ctx.needs_input_grad
        grad_cb = (t * dt[..., None, :]).sum(3).to(cb.dtype) if need_cb else None
        u = t.mul_(cb[:, :, :, None])                                                          # grad_ij cb_ij w_ij
        grad_dt = u.sum(-2).to(dt.dtype) if need_dt else None
        e = u.mul_(dt[..., None, :])                                                           # grad_ij out_ij
        grad_row = e.sum(-1) if need_row else None
        grad_col = e.sum(-2) if need_col else None
        return grad_cb, grad_row, grad_col, grad_dt, None


def _chunk_states(weights: Tensor, B: Tensor, x: Tensor) -> Tensor:
    """Each chunk's own state ``sum_j w_j B_j x_j^T``: weights (b,c,g,r,Q), B (b,c,Q,g,n), x (b,c,Q,g,r,p)
    -> (b,c,g,r,p,n). The weights scale x first, so the product is one matmul per chunk and group over all
    the group's heads at once ((r p) x Q times Q x n), not one small matmul per head."""
    # (the small weights are made contiguous in x's layout first: a strided broadcast operand makes the full-size
    # product, and its backward, about 3x slower on CPU)
    xw = x * weights.permute(0, 1, 4, 2, 3).contiguous()[..., None]
    return torch.einsum("bcjgn,bcjgrp->bcgrpn", B, xw)


def _read_out(C: Tensor, query: Tensor, entering: Tensor) -> Tensor:
    """``query_i C_i . H`` for every token: C (b,c,Q,g,n), query (b,c,g,r,Q), states (b,c,g,r,p,n)
    -> (b,c,Q,g,r,p); one matmul per chunk and group, then the per-head decay."""
    out = torch.einsum("bcign,bcgrpn->bcigrp", C, entering)
    return out * query.permute(0, 1, 4, 2, 3).contiguous()[..., None]


def _scan_chunk_states(states: Tensor, log_carry: Tensor, init: Tensor | None, *,
                       reverse: bool = False) -> tuple[Tensor, Tensor]:
    """The state entering each chunk, and the state after the last one, of ``H_c = a_c H_{c-1} + S_c``.

    ``states`` (b, C, g, r, p, n) are the chunks' own contributions ``S_c``; ``log_carry`` (b, C, g, r) is
    ``log a_c`` (-inf where the chain breaks); ``init`` (b, g, r, p, n) is ``H_{-1}`` (zero if None).
    ``entering`` is None when nothing enters (one chunk and no ``init``).
    ``reverse``: the recurrence runs right to left (``H_c = a_c H_{c+1} + S_c``; "entering" is then the
    state coming from the right and the final state the one after the first chunk).

    The recurrence runs chunk by chunk (:class:`_StatePass`, with a written-out backward): one fused
    multiply-add of one chunk's (b, g, r, p, n) state per chunk, each small enough to stay off the thread pool.
    (A block-triangular product over blocks of chunks did the same work as matmuls, but its permuted operands
    and its backward through the decay matrix cost several times more than the recurrence itself.)
    """
    bsz, nchunks, groups, rep, hdim, nstate = states.shape
    # A chunk whose own state is non-finite (a huge or non-finite token) must reach only the chunks after it (before
    # it, reversed), and through a broken chain (decay exactly 0) not even those: 0 * inf = NaN would cross it.
    # So it enters the recurrence as zeros (by selection) and the chunks after it are marked NaN afterwards.
    any_bad = not _known_finite(states)  # the usual case, all finite, skips the selections (full-size copies)
    reached = bad = None
    if any_bad:
        bad = ~torch.isfinite(states).flatten(-2).all(dim=-1)                             # (b, C, g, r)
        states = states.masked_fill(bad[..., None, None], 0.0)
        if reverse:
            reached = bad.flip(1).cummax(dim=1).values.flip(1)[:, 1:]
            reached = torch.cat([reached, torch.zeros_like(bad[:, :1])], dim=1)
        else:
            reached = torch.cat([torch.zeros_like(bad[:, :1]), bad.cummax(dim=1).values[:, :-1]], dim=1)
    entering, carry = state_recurrence(states, log_carry[..., None, None], init, reverse)
    if not any_bad:
        return entering, carry
    if entering is not None:
        entering = entering.masked_fill(reached[..., None, None], float("nan"))
    return entering, carry.masked_fill(bad.any(dim=1)[..., None, None], float("nan"))


def state_recurrence(states: Tensor, log_carry: Tensor, init: Tensor | None,
                     reverse: bool) -> tuple[Tensor | None, Tensor]:
    """``H_c = a_c H_{c-1} + S_c`` over a tile's chunks, in any layout: ``states`` (b, C, ...), ``log_carry``
    (``log a_c``) broadcastable to them, ``init`` (b, ...) or None. Returns the state entering each chunk (None when
    nothing enters: one chunk and no ``init``, so the caller skips the read-out) and the state after the last one.
    One chunk is two elementwise ops; more run :class:`_StatePass`."""
    if states.shape[1] == 1:  # e.g. one chunk per tile at a large batch
        if init is None:
            return None, states[:, 0]
        return init[:, None], states[:, 0] + torch.exp(log_carry[:, 0]).to(states.dtype) * init
    return _StatePass.apply(states, log_carry, init, reverse)


def _one_thread(device: torch.device):
    """The thread setting of the state pass's per-chunk steps: one chunk's state is small, so on CPU they run on
    one thread (no parallel region per chunk, see :mod:`.._threads`), unless ``MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS``
    asks for all threads everywhere."""
    return threads_for(0, device)


class _StatePass(torch.autograd.Function):
    """``H_c = a_c H_{c-1} + S_c`` over more than one chunk, chunk by chunk, and its written-out backward.

    states (b, C, ...) in any layout, log_carry = ``log a_c`` of a shape that broadcasts against them
    ((b, C, g, r, 1, 1) for states (b, C, g, r, p, n)), init (b, ...) or None (zero).
    Returns the state entering every chunk (b, C, g, r, p, n) and the state after the last one. ``reverse``:
    right to left (``H_c = a_c H_{c+1} + S_c``; "entering" comes from the right, the final state is the one
    after the first chunk). Backward, with ``K_c`` the gradient reaching the state that leaves chunk c:
    ``K_c = dEntering_{c+1} + a_{c+1} K_{c+1}`` (the last one is the final state's gradient), ``dS_c = K_c``,
    ``d log a_c = a_c <K_c, entering_c>`` and ``d init = dEntering_0 + a_0 K_0`` (indices mirrored in reverse).
    """

    @staticmethod
    def forward(ctx, states: Tensor, log_carry: Tensor, init: Tensor | None, reverse: bool):
        nchunks = states.shape[1]
        decay = torch.exp(log_carry).to(states.dtype)                                      # broadcasts to states
        entering = torch.empty_like(states)
        order = list(reversed(range(nchunks))) if reverse else list(range(nchunks))
        # one unbind per tensor: the loop then indexes Python lists (no op per view)
        own, dec, ent = states.unbind(1), decay.unbind(1), entering.unbind(1)
        if init is None:
            ent[order[0]].zero_()
        else:
            ent[order[0]].copy_(init)
        with _one_thread(states.device):
            for prev, c in zip(order[:-1], order[1:]):
                torch.addcmul(own[prev], dec[prev], ent[prev], out=ent[c])
            last = order[-1]
            carry = torch.addcmul(own[last], dec[last], ent[last])
        ctx.save_for_backward(decay, entering)
        ctx.reverse, ctx.has_init, ctx.log_dtype = reverse, init is not None, log_carry.dtype
        return entering, carry

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_entering: Tensor | None, grad_carry: Tensor | None):
        decay, entering = ctx.saved_tensors
        nchunks = entering.shape[1]
        order = list(reversed(range(nchunks))) if ctx.reverse else list(range(nchunks))
        grad_states = torch.empty_like(entering)   # grad_states[:, c] = K_c, the gradient of the state leaving c
        dec, ks = decay.unbind(1), grad_states.unbind(1)
        g_ent = None if grad_entering is None else grad_entering.unbind(1)
        if grad_carry is None:
            ks[order[-1]].zero_()
        else:
            ks[order[-1]].copy_(grad_carry)
        with _one_thread(entering.device):
            for c, prev in zip(reversed(order[1:]), reversed(order[:-1])):
                if g_ent is None:
                    torch.mul(dec[c], ks[c], out=ks[prev])
                else:
                    torch.addcmul(g_ent[c], dec[c], ks[c], out=ks[prev])
        grad_log = (grad_states * entering).sum_to_size(decay.shape).mul_(decay).to(ctx.log_dtype)
        grad_init = None
        if ctx.has_init and ctx.needs_input_grad[2]:
            first = order[0]
            grad_init = dec[first] * ks[first]
            if g_ent is not None:
                grad_init += g_ent[first]
        return grad_states, grad_log, grad_init, None
