"""Chunked scans in pure PyTorch: the SSD algorithm, extended to both directions in one pass.

This is the ``torch`` backend: O(L) memory (no L x L tensor), any length, CPU or GPU.

The sequence is cut into chunks of Q tokens. Within a chunk, the forward (lower), backward (upper) and
diagonal parts of the quasiseparable matrix are summed into **one** Q x Q block per head and applied with
one batched matmul. Between chunks, each direction carries an (p x n) state per head: the forward state
flows left to right, the backward state right to left. So the two directions of Hydra cost one
intra-chunk product plus two light state passes, with no flipped copies of the input and no doubled
batch (what the released Hydra code does).

All formulas are in :mod:`.scan_reference` (the oracle). With ``a = A * dt``, chunk-local cumsums
``p`` (inclusive) and ``e = p - a`` (exclusive):

* forward, query i in chunk c reads ``C~_i exp(q_i) H_c`` with ``H_c`` the state after chunk c-1;
  ``q = e`` when shifted (the state *before* token i), ``q = p`` otherwise; ``C~ = C`` shifted by one;
* backward, query i reads ``C~_i exp(p_last - q_i) G_c`` with ``G_c`` the backward state entering chunk c
  from the right; ``q = p`` when shifted, ``e`` otherwise;
* states: ``H_{c+1} = exp(p_last) H_c + sum_j exp(p_last - p_j) dt_j B_j x_j^T`` and
  ``G_{c-1} = exp(p_last) G_c + sum_j exp(e_j) dt_j B_j x_j^T``.

``seq_idx`` (packed sequences) masks pairs across segments inside a chunk and gates the states
between chunks, so neither direction, nor the shift, crosses a segment boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["scan_chunked"]


def _pad_time(t: Tensor | None, pad: int, value: float = 0.0) -> Tensor | None:
    if t is None or pad == 0:
        return t
    # pad dim 1 (time) at the end
    pad_spec = [0, 0] * (t.dim() - 2) + [0, pad]
    return F.pad(t, pad_spec, value=value)


def _chunks(t: Tensor | None, q: int) -> Tensor | None:
    """(b, l, ...) -> (b, c, q, ...)."""
    if t is None:
        return None
    return t.reshape(t.shape[0], t.shape[1] // q, q, *t.shape[2:])


def scan_chunked(
    x: Tensor,
    dt_f: Tensor | None, A_f: Tensor | None, B_f: Tensor | None, C_f: Tensor | None,
    dt_b: Tensor | None = None, A_b: Tensor | None = None, B_b: Tensor | None = None, C_b: Tensor | None = None,
    diag: Tensor | None = None, seq_idx: Tensor | None = None, initial_state: Tensor | None = None,
    *, shift: bool = False, chunk_size: int = 64, return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Chunked forward/backward scan; same arguments and result as :func:`.scan_reference.scan_reference`.

    Shapes: ``x`` (b, l, h, p); ``dt_*`` (b, l, h) (>= 0, already softplus'ed); ``A_*`` (h,);
    ``B_*``/``C_*`` (b, l, g, n); ``diag`` (b, l, h); ``seq_idx`` (b, l); ``initial_state`` (b, h, p, n).
    """
    bsz, length, heads, hdim = x.shape
    if dt_f is None and dt_b is None:
        raise ValueError("scan_chunked needs at least one direction")
    ref_B = B_f if B_f is not None else B_b
    groups, nstate = ref_B.shape[2], ref_B.shape[3]
    if heads % groups:
        raise ValueError(f"number of heads ({heads}) must be a multiple of the number of groups ({groups})")
    rep = heads // groups
    Q = min(int(chunk_size), length)  # a sequence shorter than a chunk is one chunk, not padded to one
    nchunks = -(-length // Q)
    pad = nchunks * Q - length
    dtype = x.dtype

    # Shift the query-side C by one position (Hydra's shift) before padding, so it never reads a pad.
    if shift and dt_f is not None:
        C_f = torch.cat([torch.zeros_like(C_f[:, :1]), C_f[:, :-1]], dim=1)
    if shift and dt_b is not None:
        C_b = torch.cat([C_b[:, 1:], torch.zeros_like(C_b[:, :1])], dim=1)

    x_c = _chunks(_pad_time(x, pad), Q).view(bsz, nchunks, Q, groups, rep, hdim)       # (b,c,Q,g,r,p)
    if seq_idx is not None:
        seq = _pad_time(seq_idx, pad)
        if pad:
            seq[:, length:] = seq_idx[:, -1:]
        seq = _chunks(seq, Q)                                                            # (b,c,Q)
    else:
        seq = None

    idx = torch.arange(Q, device=x.device)
    terms: list[Tensor] = []  # summed once at the end (no zero-initialised accumulator)
    block = None  # the summed intra-chunk matrix, (b, c, g, r, Q, Q)

    def direction_terms(dt: Tensor, A: Tensor, B: Tensor, C: Tensor):
        dt_c = _chunks(_pad_time(dt, pad), Q).view(bsz, nchunks, Q, groups, rep)          # (b,c,Q,g,r)
        a = dt_c * A.to(dt.dtype).view(groups, rep)
        a = a.permute(0, 1, 3, 4, 2)                                                      # (b,c,g,r,Q)
        p = a.cumsum(-1)
        e = p - a
        dtp = dt_c.permute(0, 1, 3, 4, 2)                                                 # (b,c,g,r,Q)
        B_c = _chunks(_pad_time(B, pad), Q)                                               # (b,c,Q,g,n)
        C_c = _chunks(_pad_time(C, pad), Q)
        cb = torch.einsum("bcign,bcjgn->bcgij", C_c, B_c)                                 # (b,c,g,Q,Q)
        return p, e, dtp, B_c, C_c, cb

    same = None
    if seq is not None:
        same = (seq[..., :, None] == seq[..., None, :])[:, :, None, None]                 # (b,c,1,1,Q,Q)

    # ---------------------------------------------------------------- forward (lower) direction
    final_state = None
    if dt_f is not None:
        p, e, dtp, B_c, C_c, cb = direction_terms(dt_f, A_f, B_f, C_f)
        q_log = e if shift else p
        allowed = (idx[:, None] > idx[None, :]) if shift else (idx[:, None] >= idx[None, :])
        log_decay = q_log[..., :, None] - p[..., None, :]                                 # (b,c,g,r,Q,Q)
        if same is not None:
            allowed = allowed & same
        w = torch.exp(log_decay.masked_fill(~allowed, float("-inf")))
        block = cb[:, :, :, None] * w * dtp[..., None, :]
        # chunk states: sum_j exp(p_last - p_j) dt_j B_j x_j^T
        to_end = torch.exp(p[..., -1:] - p) * dtp                                         # (b,c,g,r,Q)
        if seq is not None:
            to_end = to_end * (seq == seq[..., -1:])[:, :, None, None, :]
        states = torch.einsum("bcgrj,bcjgn,bcjgrp->bcgrpn", to_end.to(dtype), B_c, x_c)
        log_carry = p[..., -1]                                                             # (b,c,g,r)
        if seq is not None:  # the state crosses into the next chunk only within a segment
            before = torch.cat([seq[:, :1, :1], seq[:, :-1, -1:]], dim=1)[..., 0]          # seq before chunk
            crosses = (seq[:, :, -1] == before)[:, :, None, None]
            log_carry = log_carry.masked_fill(~crosses, float("-inf"))
        init = None if initial_state is None else initial_state.to(dtype).view(bsz, groups, rep, hdim, nstate)
        entering, final = _scan_chunk_states(states, log_carry, init)
        final_state = final.reshape(bsz, heads, hdim, nstate)
        query = torch.exp(q_log).to(dtype)                                                # (b,c,g,r,Q)
        if seq is not None:
            boundary = torch.cat([seq[:, :1, :1], seq[:, :-1, -1:]], dim=1)               # seq before chunk
            query = query * (seq == boundary)[:, :, None, None, :]
        terms.append(torch.einsum("bcign,bcgri,bcgrpn->bcigrp", C_c, query, entering))

    # ---------------------------------------------------------------- backward (upper) direction
    if dt_b is not None:
        p, e, dtp, B_c, C_c, cb = direction_terms(dt_b, A_b if A_b is not None else A_f, B_b, C_b)
        q_log = p if shift else e
        allowed = (idx[:, None] < idx[None, :]) if shift else (idx[:, None] <= idx[None, :])
        log_decay = e[..., None, :] - q_log[..., :, None]
        if same is not None:
            allowed = allowed & same
        w = torch.exp(log_decay.masked_fill(~allowed, float("-inf")))
        upper = cb[:, :, :, None] * w * dtp[..., None, :]
        block = upper if block is None else block + upper
        from_start = torch.exp(e) * dtp                                                    # exp(e_j) dt_j
        if seq is not None:
            from_start = from_start * (seq == seq[..., :1])[:, :, None, None, :]
        states = torch.einsum("bcgrj,bcjgn,bcjgrp->bcgrpn", from_start.to(dtype), B_c, x_c)
        log_carry = p[..., -1]
        if seq is not None:  # right to left: chunk c carries the state of chunk c+1 only within a segment
            after = torch.cat([seq[:, 1:, :1], seq[:, -1:, :1]], dim=1)[..., 0]            # seq after chunk
            log_carry = log_carry.masked_fill(~(seq[:, :, 0] == after)[:, :, None, None], float("-inf"))
        entering, _ = _scan_chunk_states(states.flip(1), log_carry.flip(1), None)
        entering = entering.flip(1)
        query = torch.exp(p[..., -1:] - q_log).to(dtype)
        if seq is not None:
            # seq of the first token after each chunk; nothing enters the last chunk from the right anyway
            after = torch.cat([seq[:, 1:, :1], seq[:, -1:, -1:]], dim=1)
            query = query * (seq == after)[:, :, None, None, :]
        terms.append(torch.einsum("bcign,bcgri,bcgrpn->bcigrp", C_c, query, entering))

    # ---------------------------------------------------------------- intra-chunk block (+ diagonal)
    if diag is not None:
        d = _chunks(_pad_time(diag, pad), Q).view(bsz, nchunks, Q, groups, rep)
        terms.append(d[..., None].to(dtype) * x_c)
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", block.to(dtype), x_c)
    for term in terms:
        y = y + term
    y = y.reshape(bsz, nchunks * Q, heads, hdim)[:, :length]
    if return_final_state:
        if final_state is None:
            raise ValueError("the final state belongs to the forward direction, which is absent")
        return y, final_state
    return y


def _segsum(log_a: Tensor) -> Tensor:
    """``out[..., i, j] = sum_{k=j+1..i} log_a[..., k]`` for j <= i, -inf above the diagonal.

    Summed per pair (a masked cumsum), never as a difference of cumulative sums: exact, and -inf entries
    (broken chains) never meet +inf.
    """
    n = log_a.shape[-1]
    x = log_a[..., :, None].expand(*log_a.shape, n)                                     # x[..., k, j] = log_a_k
    below = torch.ones(n, n, dtype=torch.bool, device=log_a.device).tril(-1)
    seg = torch.cumsum(x.masked_fill(~below, 0.0), dim=-2)
    on_or_below = torch.ones(n, n, dtype=torch.bool, device=log_a.device).tril()
    return seg.masked_fill(~on_or_below, float("-inf"))


STATE_PASS_BLOCK = 32  # chunks per block of the state pass (chunked_scan_flops counts with it)


def _scan_chunk_states(states: Tensor, log_carry: Tensor, init: Tensor | None,
                       block: int = STATE_PASS_BLOCK) -> tuple[Tensor, Tensor]:
    """The state entering each chunk, and the state after the last one, of ``H_c = a_c H_{c-1} + S_c``.

    ``states`` (b, C, g, r, p, n) are the chunks' own contributions ``S_c``; ``log_carry`` (b, C, g, r) is
    ``log a_c`` (-inf where the chain breaks); ``init`` (b, g, r, p, n) is ``H_{-1}`` (zero if None).
    Chunks are grouped ``block`` at a time: within a group the recurrence is one small matrix product (the
    decays between every pair of its chunks), and only the groups are walked in Python, so the number of
    operations does not grow with the number of chunks (a per-chunk loop of tiny ops was slow on CPU).
    """
    bsz, nchunks, groups, rep, hdim, nstate = states.shape
    size = min(block, nchunks)
    ngroups_t = -(-nchunks // size)
    pad = ngroups_t * size - nchunks
    if pad:  # trailing chunks with no contribution and no decay: they change nothing before them
        states = torch.cat([states, states.new_zeros(bsz, pad, groups, rep, hdim, nstate)], dim=1)
        log_carry = torch.cat([log_carry, log_carry.new_zeros(bsz, pad, groups, rep)], dim=1)
    st = states.view(bsz, ngroups_t, size, groups, rep, hdim, nstate)
    la = log_carry.view(bsz, ngroups_t, size, groups, rep).permute(0, 3, 4, 1, 2)       # (b,g,r,T,S)
    decay = torch.exp(_segsum(la)).to(states.dtype)                                     # (b,g,r,T,S,S)
    local = torch.einsum("bgrtij,btjgrpn->btigrpn", decay, st)                           # within each group
    from_start = torch.exp(torch.cumsum(la, dim=-1)).to(states.dtype)                   # (b,g,r,T,S)
    carry = init if init is not None else states.new_zeros(bsz, groups, rep, hdim, nstate)
    carries = []
    # select the groups' last states once: indexing the full tensor per step would make each backward step
    # allocate and fill a gradient the size of all the states
    last_local = local[:, :, -1].unbind(1)                                                 # T x (b,g,r,p,n)
    last_decay = from_start[..., -1].unbind(-1)                                           # T x (b,g,r)
    for t in range(ngroups_t):  # the state entering each group
        carries.append(carry)
        carry = last_local[t] + last_decay[t][..., None, None] * carry
    carries = torch.stack(carries, dim=1)                                                 # (b,T,g,r,p,n)
    into = from_start.permute(0, 3, 4, 1, 2)[..., None, None] * carries[:, :, None]      # (b,T,S,g,r,p,n)
    after = (local + into).reshape(bsz, ngroups_t * size, groups, rep, hdim, nstate)[:, :nchunks]
    first = init if init is not None else states.new_zeros(bsz, groups, rep, hdim, nstate)
    entering = torch.cat([first[:, None], after[:, :-1]], dim=1)
    return entering, after[:, -1]
