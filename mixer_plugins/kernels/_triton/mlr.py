"""Fused MLR (multi-level low-rank) attention forward in Triton: flash-style, no L x L tensor.

Scores (per head; see ``mixer_plugins.mixers.mlr_attention``)::

    S(i, j) = sum_l [i, j in the same level-l block] * tau_l * q_i^(l) . k_j^(l)     (/ cnt(i, j) with block_divide)

with level l's features a contiguous slice of the head dim (widths ``ranks``) and its blocks ``block_sizes[l]``
tokens aligned at 0 (None = global; the last, partial block is a block). Then the causal mask (optional), the
right-padding mask, softmax over the keys, and the values.

One program = one (query tile, batch * head); it walks the key tiles (only up to the diagonal when causal) with an
online softmax. For each (query tile, key tile) pair, only the levels the two tiles share are computed: a level whose
blocks put the two tiles apart is skipped, so far-apart tiles use only the coarse levels' features (the paper's
FLOP saving). Blocks nest, so the levels whose one block holds both tiles whole are a prefix of the levels, and their
features a prefix of the head dim: they enter **one** dot product per tile pair (and one per pair in each gradient),
unmasked. Only a level with a block boundary inside the pair (near the diagonal) is a dot of its own, masked per
entry. Accumulation in float32.

Banded (``BANDED``, for :func:`mixer_plugins.kernels.local_attention`): pairs are also restricted to
``|i - j| <= W`` or ``i < G`` or ``j < G`` (global tokens). The tile loops then start and stop at the band: a query
tile visits the key tiles holding global keys, then those meeting ``[lo - W, hi + W]`` (every key tile if it holds a
global query); a key tile's backward loop likewise visits only the query tiles that can see it. A per-entry mask
cuts the band inside the visited tiles. One global level of rank = head dim is plain (windowed) attention.

Forward and backward (``torch.autograd.Function``). Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1``
set before import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from ._common import INTERPRET_AT_IMPORT as _INTERPRET_AT_IMPORT
from ._common import available, dot_precision, tl, triton
from ._common import mm as _mm

__all__ = ["available", "mlr_attention_triton", "mlr_backward", "mlr_forward"]


if triton is not None:

    @triton.jit
    def _one_block(size, span, a_lo, a_hi, b_lo, b_hi):
        """Whether one block of a level (``size`` tokens, 0 = global) holds both tiles ``[a_lo, a_hi]`` and
        ``[b_lo, b_hi]`` whole."""
        first = a_lo // span
        return (size == 0) | ((a_hi // span == first) & (b_lo // span == first) & (b_hi // span == first))

    @triton.jit
    def _shared_prefix(lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, a_lo, a_hi, b_lo, b_hi, NUM_LEVELS: tl.constexpr):
        """(end of the features, number) of the leading levels that hold both tiles in one block: blocks nest, so
        these are a prefix of the levels, and their features the prefix ``[0, end)`` of the head dim."""
        end = a_lo * 0
        count = a_lo * 0.0
        whole = a_lo >= 0
        for lv in tl.static_range(NUM_LEVELS):
            size = tl.load(lvl_size_ptr + lv)
            whole = whole & _one_block(size, tl.maximum(size, 1), a_lo, a_hi, b_lo, b_hi)
            end = tl.where(whole, tl.load(lvl_off_ptr + lv) + tl.load(lvl_rank_ptr + lv), end)
            count += tl.where(whole, 1.0, 0.0)
        return end, count

    @triton.jit
    def _tile_scores(q_ptr, k_ptr, keyok_ptr, lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, b, h, L, H, E,
                     offs_m, m_lo, m_hi, offs_n, n_lo, n_hi, offs_r, offs_e, W, G,
                     NUM_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DIVIDE: tl.constexpr,
                     HAS_KEYOK: tl.constexpr, BANDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT: tl.constexpr):
        """Scores of one (query tile, key tile) pair from the levels the tiles share; (S, allowed, 1/cnt).

        A level whose blocks put the two tiles apart is skipped (its features are never loaded)."""
        m_ok = offs_m < L
        n_ok = offs_n < L
        # The levels that hold both tiles in one block (every entry of the pair shares them) come first, as blocks
        # nest: their features are the prefix [0, full_end) of the head dim, and enter ONE dot product. Only the
        # levels after them that still meet the pair (a block boundary inside it: near the diagonal) are masked
        # per entry, one dot each.
        full_end, n_full = _shared_prefix(lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, m_lo, m_hi, n_lo, n_hi,
                                          NUM_LEVELS)
        S = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if full_end > 0:
            e_ok = offs_e < full_end
            qf = tl.load(q_ptr + ((b * L + offs_m[:, None]) * H + h) * E + offs_e[None, :],
                         mask=m_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
            kf = tl.load(k_ptr + ((b * L + offs_n[:, None]) * H + h) * E + offs_e[None, :],
                         mask=n_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
            S = _mm(qf, tl.trans(kf), DOT)
        cnt = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + n_full
        whole = m_lo >= 0  # (a scalar True) the levels so far all hold both tiles in one block
        for lv in tl.static_range(NUM_LEVELS):
            off = tl.load(lvl_off_ptr + lv)
            rank = tl.load(lvl_rank_ptr + lv)
            size = tl.load(lvl_size_ptr + lv)              # 0 = global
            span = tl.maximum(size, 1)
            whole = whole & _one_block(size, span, m_lo, m_hi, n_lo, n_hi)
            # the tiles share this level somewhere iff their block ranges overlap
            shared = (size == 0) | ((m_lo // span <= n_hi // span) & (n_lo // span <= m_hi // span))
            if shared & ~whole:
                r_ok = offs_r < rank
                ql = tl.load(q_ptr + ((b * L + offs_m[:, None]) * H + h) * E + off + offs_r[None, :],
                             mask=m_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                kl = tl.load(k_ptr + ((b * L + offs_n[:, None]) * H + h) * E + off + offs_r[None, :],
                             mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                dot = _mm(ql, tl.trans(kl), DOT)
                same = (offs_m[:, None] // span) == (offs_n[None, :] // span)
                S += tl.where(same, dot, 0.0)
                cnt += tl.where(same, 1.0, 0.0)
        inv = tl.full([BLOCK_M, BLOCK_N], 1.0, dtype=tl.float32)
        if BLOCK_DIVIDE:
            inv = 1.0 / tl.maximum(cnt, 1.0)
            S = S * inv
        allowed = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
        if BANDED:  # |i - j| <= W, or i or j one of the first G (global) tokens
            dist = offs_m[:, None] - offs_n[None, :]
            allowed = allowed & (((dist <= W) & (dist >= -W)) | (offs_m[:, None] < G) | (offs_n[None, :] < G))
        if HAS_KEYOK:
            kok = tl.load(keyok_ptr + b * L + offs_n, mask=n_ok, other=0)
            allowed = allowed & (kok != 0)[None, :]
        return S, allowed, inv

    @triton.jit
    def _level_grads(dSr, rows_ptr, b, h, L, H, E, offs_rows, rows_lo, rows_hi, offs_cols, cols_lo, cols_hi,
                     offs_e, lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, acc, NUM_LEVELS: tl.constexpr, DOT: tl.constexpr):
        """``acc[c, f] += sum_r [r, c share level(f)] dSr[r, c] * rows[r, f]`` over the levels the tiles share.

        ``dSr`` is (rows, cols); the features ``f`` of ``rows_ptr`` (a (b, L, H, E) tensor) are taken full width and
        masked to each level's slice."""
        r_ok = offs_rows < L
        feats = tl.load(rows_ptr + ((b * L + offs_rows[:, None]) * H + h) * E + offs_e[None, :],
                        mask=r_ok[:, None] & (offs_e < E)[None, :], other=0.0).to(tl.float32)
        # the leading levels that hold both tiles in one block: one product over their features, no mask
        full_end, n_full = _shared_prefix(lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, rows_lo, rows_hi, cols_lo,
                                          cols_hi, NUM_LEVELS)
        dSt = tl.trans(dSr)
        if full_end > 0:
            acc += _mm(dSt, tl.where((offs_e < full_end)[None, :], feats, 0.0), DOT)
        whole = rows_lo >= 0
        for lv in tl.static_range(NUM_LEVELS):
            off = tl.load(lvl_off_ptr + lv)
            rank = tl.load(lvl_rank_ptr + lv)
            size = tl.load(lvl_size_ptr + lv)
            span = tl.maximum(size, 1)
            whole = whole & _one_block(size, span, rows_lo, rows_hi, cols_lo, cols_hi)
            shared = (size == 0) | ((rows_lo // span <= cols_hi // span) & (cols_lo // span <= rows_hi // span))
            if shared & ~whole:
                same = (offs_rows[:, None] // span) == (offs_cols[None, :] // span)
                level_feats = tl.where(((offs_e >= off) & (offs_e < off + rank))[None, :], feats, 0.0)
                acc += _mm(tl.trans(tl.where(same, dSr, 0.0)), level_feats, DOT)
        return acc

    @triton.jit
    def _key_tiles(m_lo, m_hi, L, W, G, CAUSAL: tl.constexpr, BANDED: tl.constexpr, BLOCK_M: tl.constexpr):
        """Key tiles a query tile ``[m_lo, m_hi]`` visits: ``na`` tiles from 0, then ``nb`` tiles from ``b_lo``.

        Not banded: every key tile (causal: up to the diagonal). Banded: the tiles holding global keys (all of them
        when the query tile holds a global query), then the tiles that meet the band ``[m_lo - W, m_hi + W]``; a
        tile outside both is never visited."""
        zero = m_lo * 0
        n_end = zero + L
        if CAUSAL:
            n_end = m_hi + 1
        a_end = n_end
        b_lo = zero
        b_end = zero
        if BANDED:
            if m_lo >= G:
                a_end = tl.minimum(tl.cdiv(zero + G, BLOCK_M) * BLOCK_M, n_end)
                b_lo = tl.maximum((tl.maximum(m_lo - W, 0) // BLOCK_M) * BLOCK_M, a_end)
                b_end = tl.minimum(n_end, m_hi + W + 1)
        na = tl.cdiv(a_end, BLOCK_M)
        nb = tl.cdiv(tl.maximum(b_end - b_lo, 0), BLOCK_M)
        return na, b_lo, nb

    @triton.jit
    def _query_tiles(n_lo, n_hi, L, W, G, CAUSAL: tl.constexpr, BANDED: tl.constexpr, BLOCK_M: tl.constexpr):
        """Query tiles a key tile ``[n_lo, n_hi]`` is seen by: ``na`` tiles from ``a_lo``, then ``nb`` from ``b_lo``.

        Not banded: every query tile (causal: from the diagonal). Banded: every query tile when the key tile holds a
        global key; else the tiles holding global queries (none when causal: they lie before the keys), then the
        tiles that meet the band ``[n_lo - W, n_hi + W]`` (causal: ``[n_lo, n_hi + W]``)."""
        zero = n_lo * 0
        a_lo = zero
        if CAUSAL:
            a_lo = n_lo       # earlier query tiles see none of these keys
        a_end = zero + L
        b_lo = zero
        b_end = zero
        if BANDED:
            if n_lo >= G:
                a_end = tl.minimum(tl.cdiv(zero + G, BLOCK_M) * BLOCK_M, a_end)
                if CAUSAL:
                    a_end = a_lo
                    b_lo = n_lo
                else:
                    b_lo = tl.maximum((tl.maximum(n_lo - W, 0) // BLOCK_M) * BLOCK_M, a_end)
                b_end = tl.minimum(zero + L, n_hi + W + 1)
        na = tl.cdiv(tl.maximum(a_end - a_lo, 0), BLOCK_M)
        nb = tl.cdiv(tl.maximum(b_end - b_lo, 0), BLOCK_M)
        return a_lo, na, b_lo, nb

    @triton.jit
    def _visit(t, a_lo, na, b_lo, L, BLOCK_M: tl.constexpr):
        """The ``t``-th tile a loop of :func:`_key_tiles` / :func:`_query_tiles` visits: ``na`` tiles from ``a_lo``,
        then tiles from ``b_lo``; returns (its first index, its indices, its last index in range)."""
        lo = a_lo + t * BLOCK_M
        if t >= na:
            lo = b_lo + (t - na) * BLOCK_M
        return lo, lo + tl.arange(0, BLOCK_M), tl.minimum(lo + BLOCK_M, L) - 1

    @triton.jit
    def _mlr_fwd_kernel(
        q_ptr, k_ptr, v_ptr, keyok_ptr, lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, y_ptr, lse_ptr,
        L, H, E, P, W, G,
        NUM_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DIVIDE: tl.constexpr, HAS_KEYOK: tl.constexpr,
        BANDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
        DOT: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // H
        h = pid % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        offs_e = tl.arange(0, BLOCK_E)
        m_ok = offs_m < L
        m_lo = pid_m * BLOCK_M
        m_hi = tl.minimum(m_lo + BLOCK_M, L) - 1
        row_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        na, b_lo, nb = _key_tiles(m_lo, m_hi, L, W, G, CAUSAL, BANDED, BLOCK_M)
        t = 0
        while t < na + nb:
            n_lo, offs_n, n_hi = _visit(t, 0, na, b_lo, L, BLOCK_M)
            S, allowed, inv = _tile_scores(q_ptr, k_ptr, keyok_ptr, lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr,
                                           b, h, L, H, E, offs_m, m_lo, m_hi, offs_n, n_lo, n_hi, offs_r, offs_e,
                                           W, G,
                                           NUM_LEVELS, CAUSAL, BLOCK_DIVIDE, HAS_KEYOK, BANDED, BLOCK_M, BLOCK_M, DOT)
            S = tl.where(allowed, S, -1.0e30)
            new_max = tl.maximum(row_max, tl.max(S, 1))
            alpha = tl.exp(row_max - new_max)
            prob = tl.where(allowed, tl.exp(S - new_max[:, None]), 0.0)
            row_sum = row_sum * alpha + tl.sum(prob, 1)
            v = tl.load(v_ptr + ((b * L + offs_n[:, None]) * H + h) * P + offs_p[None, :],
                        mask=(offs_n < L)[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + _mm(prob, v, DOT)
            row_max = new_max
            t += 1
        row_sum = tl.maximum(row_sum, 1.0e-30)
        out = acc / row_sum[:, None]
        tl.store(y_ptr + ((b * L + offs_m[:, None]) * H + h) * P + offs_p[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & (offs_p < P)[None, :])
        tl.store(lse_ptr + (b * L + offs_m) * H + h, row_max + tl.log(row_sum), mask=m_ok)

    @triton.jit
    def _tile_dscores(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, keyok_ptr, lvl_off_ptr, lvl_rank_ptr,
                      lvl_size_ptr, b, h, L, H, E, P, offs_m, m_lo, m_hi, offs_n, n_lo, n_hi, offs_r, offs_e, offs_p,
                      W, G,
                      NUM_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DIVIDE: tl.constexpr,
                      HAS_KEYOK: tl.constexpr, BANDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT: tl.constexpr):
        """Recomputed probabilities of a tile pair and the gradient w.r.t. the undivided level sums: (P, dSr, dO)."""
        S, allowed, inv = _tile_scores(q_ptr, k_ptr, keyok_ptr, lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr,
                                       b, h, L, H, E, offs_m, m_lo, m_hi, offs_n, n_lo, n_hi, offs_r, offs_e, W, G,
                                       NUM_LEVELS, CAUSAL, BLOCK_DIVIDE, HAS_KEYOK, BANDED, BLOCK_M, BLOCK_N, DOT)
        m_ok = offs_m < L
        lse = tl.load(lse_ptr + (b * L + offs_m) * H + h, mask=m_ok, other=0.0)
        delta = tl.load(delta_ptr + (b * L + offs_m) * H + h, mask=m_ok, other=0.0)
        prob = tl.where(allowed, tl.exp(S - lse[:, None]), 0.0)
        do = tl.load(do_ptr + ((b * L + offs_m[:, None]) * H + h) * P + offs_p[None, :],
                     mask=m_ok[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + ((b * L + offs_n[:, None]) * H + h) * P + offs_p[None, :],
                    mask=(offs_n < L)[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
        dprob = _mm(do, tl.trans(v), DOT)
        dSr = prob * (dprob - delta[:, None]) * inv
        return prob, dSr, do

    @triton.jit
    def _mlr_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, keyok_ptr, lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr,
        dq_ptr, L, H, E, P, W, G,
        NUM_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DIVIDE: tl.constexpr, HAS_KEYOK: tl.constexpr,
        BANDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
        DOT: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // H
        h = pid % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        offs_e = tl.arange(0, BLOCK_E)
        m_lo = pid_m * BLOCK_M
        m_hi = tl.minimum(m_lo + BLOCK_M, L) - 1
        dq = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
        na, b_lo, nb = _key_tiles(m_lo, m_hi, L, W, G, CAUSAL, BANDED, BLOCK_M)
        t = 0
        while t < na + nb:
            n_lo, offs_n, n_hi = _visit(t, 0, na, b_lo, L, BLOCK_M)
            prob, dSr, do = _tile_dscores(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, keyok_ptr, lvl_off_ptr,
                                          lvl_rank_ptr, lvl_size_ptr, b, h, L, H, E, P, offs_m, m_lo, m_hi,
                                          offs_n, n_lo, n_hi, offs_r, offs_e, offs_p, W, G,
                                          NUM_LEVELS, CAUSAL, BLOCK_DIVIDE, HAS_KEYOK, BANDED, BLOCK_M, BLOCK_M, DOT)
            # dq[i] = sum_j dSr[i, j] k_j (level-masked): the "rows" of the product are the keys
            dq = _level_grads(tl.trans(dSr), k_ptr, b, h, L, H, E, offs_n, n_lo, n_hi, offs_m, m_lo, m_hi, offs_e,
                              lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, dq, NUM_LEVELS, DOT)
            t += 1
        tl.store(dq_ptr + ((b * L + offs_m[:, None]) * H + h) * E + offs_e[None, :], dq,
                 mask=(offs_m < L)[:, None] & (offs_e < E)[None, :])

    @triton.jit
    def _mlr_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, keyok_ptr, lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr,
        dk_ptr, dv_ptr, L, H, E, P, W, G,
        NUM_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DIVIDE: tl.constexpr, HAS_KEYOK: tl.constexpr,
        BANDED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
        DOT: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // H
        h = pid % H
        offs_n = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        offs_e = tl.arange(0, BLOCK_E)
        n_lo = pid_n * BLOCK_M
        n_hi = tl.minimum(n_lo + BLOCK_M, L) - 1
        dk = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
        dv = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        a_lo, na, b_lo, nb = _query_tiles(n_lo, n_hi, L, W, G, CAUSAL, BANDED, BLOCK_M)
        t = 0
        while t < na + nb:
            m_lo, offs_m, m_hi = _visit(t, a_lo, na, b_lo, L, BLOCK_M)
            prob, dSr, do = _tile_dscores(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, keyok_ptr, lvl_off_ptr,
                                          lvl_rank_ptr, lvl_size_ptr, b, h, L, H, E, P, offs_m, m_lo, m_hi,
                                          offs_n, n_lo, n_hi, offs_r, offs_e, offs_p, W, G,
                                          NUM_LEVELS, CAUSAL, BLOCK_DIVIDE, HAS_KEYOK, BANDED, BLOCK_M, BLOCK_M, DOT)
            dv += _mm(tl.trans(prob), do, DOT)
            dk = _level_grads(dSr, q_ptr, b, h, L, H, E, offs_m, m_lo, m_hi, offs_n, n_lo, n_hi, offs_e,
                              lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, dk, NUM_LEVELS, DOT)
            t += 1
        n_ok = offs_n < L
        tl.store(dk_ptr + ((b * L + offs_n[:, None]) * H + h) * E + offs_e[None, :], dk,
                 mask=n_ok[:, None] & (offs_e < E)[None, :])
        tl.store(dv_ptr + ((b * L + offs_n[:, None]) * H + h) * P + offs_p[None, :], dv,
                 mask=n_ok[:, None] & (offs_p < P)[None, :])


class _Levels:
    """Level tables and block sizes of one call."""

    def __init__(self, q: Tensor, v: Tensor, ranks: Sequence[int], block_sizes: Sequence[Optional[int]],
                 tile_size: int):
        dev = q.device
        offsets = [sum(ranks[:i]) for i in range(len(ranks))]
        self.off = torch.tensor(offsets, dtype=torch.int32, device=dev)
        self.rank = torch.tensor(list(ranks), dtype=torch.int32, device=dev)
        self.size = torch.tensor([0 if s is None else int(s) for s in block_sizes], dtype=torch.int32, device=dev)
        L, E, P = q.shape[1], q.shape[-1], v.shape[-1]
        # tl.dot needs >= 16 on GPUs; the interpreter takes any size (tests use tiny tiles to cross many boundaries)
        floor = 1 if _INTERPRET_AT_IMPORT else 16
        self.block_m = max(floor, triton.next_power_of_2(min(int(tile_size), L)))
        self.blocks = dict(BLOCK_M=self.block_m, BLOCK_R=max(floor, triton.next_power_of_2(max(ranks))),
                           BLOCK_P=max(floor, triton.next_power_of_2(P)))
        self.block_e = max(floor, triton.next_power_of_2(E))
        self.num_levels = len(ranks)

    def tables(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.off, self.rank, self.size


def mlr_forward(qs: Tensor, k: Tensor, v: Tensor, keyok: Tensor | None, levels: _Levels, causal: bool,
                block_divide: bool, window: int | None = None, num_global: int = 0) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: output (b, L, H, P) in v's dtype and row log-sum-exp (b, L, H) float32.

    ``window`` (not None): also restrict to the band ``|i - j| <= window`` or ``i < num_global`` or
    ``j < num_global``; key tiles outside it are never visited."""
    b, L, H, E = qs.shape
    P = v.shape[-1]
    y = torch.empty(b, L, H, P, dtype=v.dtype, device=v.device)
    lse = torch.empty(b, L, H, dtype=torch.float32, device=v.device)
    grid = (triton.cdiv(L, levels.block_m), b * H)
    _mlr_fwd_kernel[grid](qs, k, v, keyok if keyok is not None else qs, *levels.tables(), y, lse, L, H, E, P,
                          *_band_args(window, num_global), **_flags(levels, v, keyok, causal, block_divide, window),
                          **levels.blocks, BLOCK_E=levels.block_e)
    return y, lse


def mlr_backward(dy: Tensor, qs: Tensor, k: Tensor, v: Tensor, keyok: Tensor | None, y: Tensor, lse: Tensor,
                 levels: _Levels, causal: bool, block_divide: bool, window: int | None = None,
                 num_global: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the two backward kernels (dq per query tile; dk, dv per key tile): float32 (dq, dk, dv)."""
    b, L, H, E = qs.shape
    P = v.shape[-1]
    dy = dy.contiguous()
    delta = (dy.float() * y.float()).sum(-1).contiguous()            # D_i = dO_i . O_i
    dq = torch.empty(b, L, H, E, dtype=torch.float32, device=qs.device)
    dk = torch.empty_like(dq)
    dv = torch.empty(b, L, H, P, dtype=torch.float32, device=qs.device)
    grid = (triton.cdiv(L, levels.block_m), b * H)
    common = (qs, k, v, dy, lse, delta, keyok if keyok is not None else qs, *levels.tables())
    flags = _flags(levels, v, keyok, causal, block_divide, window)
    band = _band_args(window, num_global)
    _mlr_bwd_dq_kernel[grid](*common, dq, L, H, E, P, *band, **flags, **levels.blocks, BLOCK_E=levels.block_e)
    _mlr_bwd_dkdv_kernel[grid](*common, dk, dv, L, H, E, P, *band, **flags, **levels.blocks, BLOCK_E=levels.block_e)
    return dq, dk, dv


def _flags(levels: _Levels, v: Tensor, keyok: Tensor | None, causal: bool, block_divide: bool,
           window: int | None) -> dict:
    return dict(NUM_LEVELS=levels.num_levels, CAUSAL=bool(causal), BLOCK_DIVIDE=bool(block_divide),
                HAS_KEYOK=keyok is not None, BANDED=window is not None, DOT=dot_precision(v.dtype))


def _band_args(window: int | None, num_global: int) -> tuple[int, int]:
    return (0 if window is None else int(window)), int(num_global)


class _MLRFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qs, k, v, keyok, levels: _Levels, causal: bool, block_divide: bool,
                window: int | None = None, num_global: int = 0):
        y, lse = mlr_forward(qs, k, v, keyok, levels, causal, block_divide, window, num_global)
        ctx.save_for_backward(qs, k, v, keyok, y, lse)
        ctx.args = (levels, causal, block_divide, window, num_global)
        return y

    @staticmethod
    def backward(ctx, dy):
        qs, k, v, keyok, y, lse = ctx.saved_tensors
        dq, dk, dv = mlr_backward(dy, qs, k, v, keyok, y, lse, *ctx.args)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def mlr_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, ranks: Sequence[int], block_sizes: Sequence[Optional[int]],
    level_scales: Sequence[float], *, block_divide: bool = True, causal: bool = False, mask: Tensor | None = None,
    tile_size: int = 64,
) -> Tensor:
    """MLR attention ``softmax(S + masks) v`` without materializing ``S``; differentiable in q, k, v.

    q, k (b, l, h, e) with ``sum(ranks) == e`` (level l = the next ``ranks[l]`` features); v (b, l, h, p);
    ``block_sizes[l]`` tokens per level-l block (None = global; blocks aligned at 0; nested, coarse first, as the
    mixer validates); ``level_scales[l]`` = tau_l (the mixer's ``level_scales``, already divided by the number of
    levels when ``divide_by_levels``); ``mask`` bool (b, l), True on real tokens, right padding (pad keys are
    excluded; a row with no real token keeps all keys, as ``attention_bias_mask``). ``tile_size``: query/key tile
    (rounded up to a power of two, at least 16 on GPUs). Returns (b, l, h, p) in v's dtype (pad outputs are not
    zeroed: the mixer does that).

    Backward (flash-style: the row log-sum-exp is kept, the probabilities are recomputed): one kernel for dq (per
    query tile) and one for dk, dv (per key tile), each skipping the levels a tile pair does not share.
    """
    reason = available(q.device)
    if reason is not None:
        raise RuntimeError(f"triton MLR attention unavailable: {reason}")
    E = q.shape[-1]
    if sum(ranks) != E or len(ranks) != len(block_sizes) or len(ranks) != len(level_scales):
        raise ValueError(f"ranks {list(ranks)} must sum to the q/k width {E} and match block_sizes/level_scales")
    # tau_l folded into the queries, feature by feature (autograd carries it back to q)
    tau = torch.cat([torch.full((r,), float(s), dtype=torch.float32, device=q.device)
                     for r, s in zip(ranks, level_scales)])
    qs = (q.float() * tau).contiguous()
    keyok = None
    if mask is not None:
        keyok = (mask | ~mask.any(dim=1, keepdim=True)).to(torch.int8).contiguous()
    levels = _Levels(q, v, ranks, block_sizes, tile_size)
    return _MLRFunction.apply(qs, k.contiguous(), v.contiguous(), keyok, levels, causal, block_divide)
