"""Fused MLR (multi-level low-rank) attention in Triton, forward and backward: flash-style, no L x L tensor.

The scores are those of :func:`mixer_plugins.kernels.mlr_attention`. Blocks nest, so the levels a pair shares are a
prefix ``0..m`` and its score is one dot product of the first ``W_m = r_0 + ... + r_m`` features. The host
(:func:`.plan.tile_plan`) sorts the (row tile, column tile) pairs of each program into runs of *uniform* pairs, grouped
by class (every pair of the run shares levels ``0..m``), and a short list of *mixed* pairs (a block boundary, the
causal diagonal or a band edge inside the pair, or the partial last tile). A kernel program holds one row tile and

* for each class (a compile-time loop; its width ``W_m``, the dot's width ``K`` = ``W_m`` rounded up to a power of
  two, at least 16, and its divisor are constants), loads its resident operand once at width ``K`` with the level
  scales, ``log2(e)`` and the divisor folded in (in registers, input dtype), then streams the class's column tiles in
  pipelined ``for`` loops: one unmasked dot of width ``K`` per tile pair, ``exp2``, no per-entry mask;
* for the mixed pairs, computes each level's dot masked per entry (the general path).

Forward: one program per (query tile, batch * head), online softmax, the row log-sum-exp saved (base 2). Backward
(flash attention 2): one kernel for dq (per query tile), one for dk and dv (per key tile, the plan transposed); the
gradients of each class are accumulated at its width and added to the float32 outputs once per class.

Banded (``window`` not None, for :func:`mixer_plugins.kernels.local_attention`): pairs are also restricted to
``|i - j| <= window`` or ``i < num_global`` or ``j < num_global``; tile pairs outside the band are never visited
(the plan skips them), pairs on its edges are mixed. One global level of rank = head dim is plain (windowed)
attention.

Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` set before import.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from .._dispatch import row_span
from .._requirements import MAX_ROW_SPAN
from .._triton._common import INTERPRET, available, dot_precision_split, grid_1d, on_device, pow2, require, tl, triton
from .._triton._common import INTERPRET_AT_IMPORT as _INTERPRET_AT_IMPORT
from .._triton._common import dot as _dot
from .._triton._common import rows_last as _rows_last
from .plan import tile_classes, tile_plan

__all__ = ["MLRSpec", "Tiles", "available", "mlr_attention_triton", "mlr_triton"]



if triton is not None:

    @triton.jit
    def _col_scale(offs, OFFS: tl.constexpr, RANKS: tl.constexpr, TAUS: tl.constexpr, NL: tl.constexpr):
        """Per feature ``offs``: its level's scale ``tau_l`` (0 beyond the last level)."""
        s = offs.to(tl.float32) * 0.0
        for lv in tl.static_range(NL):
            s = tl.where((offs >= OFFS[lv]) & (offs < OFFS[lv] + RANKS[lv]), TAUS[lv], s)
        return s

    @triton.jit
    def _scaled(x, offs, DIV: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr, TAUS: tl.constexpr,
                NL: tl.constexpr):
        """``x`` with each feature's level scale, ``log2(e)`` and ``1 / DIV`` folded in, in x's dtype."""
        scale = _col_scale(offs, OFFS, RANKS, TAUS, NL) * (1.4426950408889634 / DIV)
        return (x.to(tl.float32) * scale[None, :]).to(x.dtype)

    @triton.jit
    def _add_to(base, rows, row_ok, cols, LIMIT: tl.constexpr, stride, x):
        """``base[rows * stride + cols] += x`` (float32) where ``row_ok`` and ``cols < LIMIT``."""
        ptrs = base + rows[:, None] * stride + cols[None, :]
        msk = row_ok[:, None] & (cols < LIMIT)[None, :]
        tl.store(ptrs, tl.load(ptrs, mask=msk, other=0.0) + x, mask=msk)

    @triton.jit
    def _span(t, BLOCK: tl.constexpr, L):
        """Tile ``t`` of ``BLOCK`` tokens: its first and last token, its offsets and which of them are < L."""
        lo = t * BLOCK
        offs = lo + tl.arange(0, BLOCK)
        return lo, tl.minimum(lo + BLOCK, L) - 1, offs, offs < L

    @triton.jit
    def _tile(base, rows, stride, cols, row_ok, LIMIT: tl.constexpr, WIDTH: tl.constexpr,
              ROWS_FULL: tl.constexpr):
        """``base[rows * stride + cols]`` (rows x WIDTH), 0 at columns >= LIMIT and, unless ``ROWS_FULL``, at rows
        where ``row_ok`` is False."""
        ptrs = base + rows[:, None] * stride + cols[None, :]
        if ROWS_FULL:
            if LIMIT >= WIDTH:
                x = tl.load(ptrs)
            else:
                x = tl.load(ptrs, mask=(cols < LIMIT)[None, :], other=0.0)
        else:
            if LIMIT >= WIDTH:
                x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
            else:
                x = tl.load(ptrs, mask=row_ok[:, None] & (cols < LIMIT)[None, :], other=0.0)
        return x

    @triton.jit
    def _allowed(qi, kj, L, kl, window, num_global, CAUSAL: tl.constexpr, BANDED: tl.constexpr,
                 HAS_KEYLEN: tl.constexpr):
        """Which (query ``qi``, key ``kj``) entries are allowed (broadcast index tensors)."""
        ok = (qi < L) & (kj < L)
        if CAUSAL:
            ok = ok & (kj <= qi)
        if BANDED:
            d = qi - kj
            ok = ok & (((d <= window) & (d >= -window)) | (qi < num_global) | (kj < num_global))
        if HAS_KEYLEN:
            ok = ok & (kj < kl)
        return ok

    @triton.jit
    def _share(r_lo, r_hi, c_lo, c_hi, SIZE: tl.constexpr):
        """Whether a row tile and a column tile meet a common block of ``SIZE`` tokens."""
        return (r_lo // SIZE <= c_hi // SIZE) & (c_lo // SIZE <= r_hi // SIZE)

    @triton.jit
    def _mixed_scores(rs, cs, offs_r, r_lo, r_hi, offs_c, c_lo, c_hi, offs_e, NL: tl.constexpr,
                      NG: tl.constexpr, WG: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr,
                      SIZES: tl.constexpr, DOT: tl.constexpr):
        """Scores of a mixed pair, the held rows ``rs`` (scaled) against the streamed columns ``cs``, masked per
        entry: ``P`` accumulates the dots of the levels level by level (the global ones, features ``[0, WG)``, in
        one), and an entry takes ``P`` after the last level whose block holds it. A finer level the tiles do not
        meet is skipped (so are the levels below it: blocks nest). The level masks go on the streamed operand: masked
        copies of the held one would be hoisted out of the tile loop, one per level, all alive at once."""
        zero_c = tl.zeros_like(cs)
        P = tl.zeros((rs.shape[0], cs.shape[0]), dtype=tl.float32)
        if NG > 0:
            P = _dot(rs, tl.trans(tl.where((offs_e < WG)[None, :], cs, zero_c)), P, DOT)
        S = P
        for lv in tl.static_range(NG, NL):
            if _share(r_lo, r_hi, c_lo, c_hi, SIZES[lv]):
                sel = (offs_e >= OFFS[lv]) & (offs_e < OFFS[lv] + RANKS[lv])
                P = _dot(rs, tl.trans(tl.where(sel[None, :], cs, zero_c)), P, DOT)
                S = tl.where((offs_r[:, None] // SIZES[lv]) == (offs_c[None, :] // SIZES[lv]), P, S)
        return S

    @triton.jit
    def _shared_levels(offs_r, offs_c, NL: tl.constexpr, NG: tl.constexpr, SIZES: tl.constexpr):
        """Per entry, the number of levels whose block holds both tokens (at least 1: the divisor)."""
        cnt = tl.zeros((offs_r.shape[0], offs_c.shape[0]), dtype=tl.float32) + NG
        for lv in tl.static_range(NG, NL):
            cnt += tl.where((offs_r[:, None] // SIZES[lv]) == (offs_c[None, :] // SIZES[lv]), 1.0, 0.0)
        return tl.maximum(cnt, 1.0)

    @triton.jit
    def _mixed_grads(ds, cs, acc, offs_r, r_lo, r_hi, offs_c, c_lo, c_hi, offs_e, NL: tl.constexpr,
                     NG: tl.constexpr, WG: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr,
                     SIZES: tl.constexpr, DOT: tl.constexpr):
        """``acc[r, f] += sum_c [r, c share level(f)] ds[r, c] cs[c, f]``: the gradient of :func:`_mixed_scores`
        with respect to its rows, given the score gradient ``ds`` (already divided by the counts)."""
        zero_c = tl.zeros_like(cs)
        if NG > 0:
            acc = _dot(ds.to(cs.dtype), tl.where((offs_e < WG)[None, :], cs, zero_c), acc, DOT)
        for lv in tl.static_range(NG, NL):
            if _share(r_lo, r_hi, c_lo, c_hi, SIZES[lv]):
                sel = (offs_e >= OFFS[lv]) & (offs_e < OFFS[lv] + RANKS[lv])
                same = (offs_r[:, None] // SIZES[lv]) == (offs_c[None, :] // SIZES[lv])
                acc = _dot(tl.where(same, ds, 0.0).to(cs.dtype), tl.where(sel[None, :], cs, zero_c), acc, DOT)
        return acc

    @triton.jit
    def _program(n_tiles, H, L, keylen_ptr, CAUSAL: tl.constexpr, HAS_KEYLEN: tl.constexpr):
        """(row tile, batch * head, batch, head, key length) of this program: one flat grid (no 65,535 limit on
        batch * heads); causal query tiles in decreasing order (the longest rows start first)."""
        pid = tl.program_id(0)
        bh = pid // n_tiles
        t = pid % n_tiles
        if CAUSAL:
            t = n_tiles - 1 - t
        kl = L
        if HAS_KEYLEN:
            kl = tl.load(keylen_ptr + bh // H)
        return t, bh, bh // H, bh % H, kl

    @triton.jit
    def _softmax_step(S, v_tile, m_i, l_i, acc, DOT: tl.constexpr):
        """Online softmax: fold a tile of base-2 scores ``S`` (-inf where not allowed) and its values in."""
        m_new = tl.maximum(m_i, tl.max(S, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(S - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], DOT)
        return m_new, l_i, acc

    @triton.jit
    def _fwd_uniform(qk, k_base, v_base, nt, skl, svl, kl, m_i, l_i, acc, offs_k, offs_p,
                     W: tl.constexpr, K: tl.constexpr, E: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                     HAS_KEYLEN: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One uniform key tile of the forward: an unmasked dot of width ``K`` (scale folded into ``qk``)."""
        offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        S = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if W > 0:
            kk = _tile(k_base, offs_n, skl, offs_k, offs_n, E, K, True)
            S = _dot(qk, tl.trans(kk), S, DOT)
        if HAS_KEYLEN:
            S = tl.where((offs_n < kl)[None, :], S, float("-inf"))
        vv = _tile(v_base, offs_n, svl, offs_p, offs_n, P, BLOCK_P, True)
        return _softmax_step(S, vv, m_i, l_i, acc, DOT)

    @triton.jit
    def _dq_uniform(qk, do, lse, delta, k_base, v_base, nt, skl, svl, kl, dq, offs_k, offs_p,
                    W: tl.constexpr, K: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                    HAS_KEYLEN: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One uniform key tile of the dq kernel: ``dq += dS k`` at width ``K`` (columns from ``W`` on are 0)."""
        offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = _tile(k_base, offs_n, skl, offs_k, offs_n, W, K, True)
        vv = _tile(v_base, offs_n, svl, offs_p, offs_n, P, BLOCK_P, True)
        S = _dot(qk, tl.trans(kk), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT)
        p = tl.math.exp2(S - lse[:, None])
        if HAS_KEYLEN:
            p = tl.where((offs_n < kl)[None, :], p, 0.0)
        dp = _dot(do, tl.trans(vv), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT)
        ds = p * (dp - delta[:, None])
        return _dot(ds.to(kk.dtype), kk, dq, DOT)

    @triton.jit
    def _dkdv_uniform(kk, vv, q_base, do_base, lse_base, delta_base, mt, sql, sdl, kl, offs_n, dk, dv, offs_k,
                      offs_p, W: tl.constexpr, K: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                      HAS_KEYLEN: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """One uniform query tile of the dk/dv kernel: ``dv += P^T dO`` and ``dk += dS^T q`` at width ``K``."""
        offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        do = _tile(do_base, offs_m, sdl, offs_p, offs_m, P, BLOCK_P, True)
        lse = tl.load(lse_base + offs_m)
        St = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if W > 0:
            qq = _tile(q_base, offs_m, sql, offs_k, offs_m, W, K, True)
            St = _dot(kk, tl.trans(qq), St, DOT)
        pt = tl.math.exp2(St - lse[None, :])
        if HAS_KEYLEN:
            pt = tl.where((offs_n < kl)[:, None], pt, 0.0)
        dv = _dot(pt.to(vv.dtype), do, dv, DOT)
        if W > 0:
            delta = tl.load(delta_base + offs_m)
            dpt = _dot(vv, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT)
            dst = pt * (dpt - delta[None, :])
            dk = _dot(dst.to(qq.dtype), qq, dk, DOT)
        return dk, dv

    @triton.jit
    def _fwd_class(q_base, k_base, v_base, ptr, segs_ptr, offs_m, m_ok, sql, skl, svl, kl, m_i, l_i, acc, offs_p,
                   W: tl.constexpr, K: tl.constexpr, DIV: tl.constexpr, E: tl.constexpr, P: tl.constexpr,
                   BLOCK_P: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr, TAUS: tl.constexpr,
                   NL: tl.constexpr, HAS_KEYLEN: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        """The forward's uniform key tiles of one class (``W`` shared features, divisor ``DIV``): the query tile
        loaded once at width ``K`` with the scales folded in, then a pipelined loop over each run of key tiles."""
        s = tl.load(ptr)
        s_end = tl.load(ptr + 1)
        if s_end > s:
            offs_k = tl.arange(0, K)
            qk = _scaled(_tile(q_base, offs_m, sql, offs_k, m_ok, W, K, False), offs_k, DIV, OFFS, RANKS, TAUS, NL)
            while s < s_end:
                n_first = tl.load(segs_ptr + 2 * s)
                n_end = tl.load(segs_ptr + 2 * s + 1)
                if HAS_KEYLEN:
                    n_end = tl.minimum(n_end, tl.cdiv(kl, BLOCK_N))
                if INTERPRET:  # (the 3.5 interpreter cannot take tensor bounds in range())
                    nt = n_first
                    while nt < n_end:
                        m_i, l_i, acc = _fwd_uniform(qk, k_base, v_base, nt, skl, svl, kl, m_i, l_i, acc, offs_k,
                                                     offs_p, W, K, E, P, BLOCK_P, HAS_KEYLEN, DOT, BLOCK_M, BLOCK_N)
                        nt += 1
                else:
                    for nt in range(n_first, n_end):
                        m_i, l_i, acc = _fwd_uniform(qk, k_base, v_base, nt, skl, svl, kl, m_i, l_i, acc, offs_k,
                                                     offs_p, W, K, E, P, BLOCK_P, HAS_KEYLEN, DOT, BLOCK_M, BLOCK_N)
                s += 1
        return m_i, l_i, acc

    @triton.jit
    def _dq_class(q_base, k_base, v_base, dq_base, ptr, segs_ptr, do, lse, delta, offs_m, m_ok, sql, skl, svl, kl,
                  H, offs_p, W: tl.constexpr, K: tl.constexpr, DIV: tl.constexpr, E: tl.constexpr, P: tl.constexpr,
                  BLOCK_P: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr, TAUS: tl.constexpr,
                  NL: tl.constexpr, HAS_KEYLEN: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
        """The dq kernel's uniform key tiles of one class; the class's dq (width ``K``) is added to the float32
        output once. Pairs sharing no level (``W == 0``) score 0: nothing flows to q."""
        if W > 0:
            s = tl.load(ptr)
            s_end = tl.load(ptr + 1)
            if s_end > s:
                offs_k = tl.arange(0, K)
                qk = _scaled(_tile(q_base, offs_m, sql, offs_k, m_ok, W, K, False), offs_k, DIV, OFFS, RANKS, TAUS,
                             NL)
                dq = tl.zeros([BLOCK_M, K], dtype=tl.float32)
                while s < s_end:
                    n_first = tl.load(segs_ptr + 2 * s)
                    n_end = tl.load(segs_ptr + 2 * s + 1)
                    if HAS_KEYLEN:
                        n_end = tl.minimum(n_end, tl.cdiv(kl, BLOCK_N))
                    if INTERPRET:
                        nt = n_first
                        while nt < n_end:
                            dq = _dq_uniform(qk, do, lse, delta, k_base, v_base, nt, skl, svl, kl, dq, offs_k, offs_p,
                                             W, K, P, BLOCK_P, HAS_KEYLEN, DOT, BLOCK_M, BLOCK_N)
                            nt += 1
                    else:
                        for nt in range(n_first, n_end):
                            dq = _dq_uniform(qk, do, lse, delta, k_base, v_base, nt, skl, svl, kl, dq, offs_k, offs_p,
                                             W, K, P, BLOCK_P, HAS_KEYLEN, DOT, BLOCK_M, BLOCK_N)
                    s += 1
                # the gradient of the original q: the level scales and the divisor (log2(e) is not in dS)
                _add_to(dq_base, offs_m, m_ok, offs_k, W, H * E,
                        dq * (_col_scale(offs_k, OFFS, RANKS, TAUS, NL) / DIV)[None, :])

    @triton.jit
    def _dkdv_class(q_base, k_base, vv, do_base, dk_base, lse_base, delta_base, ptr, segs_ptr, live, offs_n, n_ok,
                    sql, skl, sdl, kl, H, dv, offs_p, W: tl.constexpr, K: tl.constexpr, DIV: tl.constexpr,
                    E: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr,
                    TAUS: tl.constexpr, NL: tl.constexpr, HAS_KEYLEN: tl.constexpr, DOT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The dk/dv kernel's uniform query tiles of one class: the key tile loaded once at width ``K`` with the
        scales folded in; the class's dk is added to the float32 output once; returns dv."""
        s = tl.load(ptr)
        s_end = tl.load(ptr + 1)
        if live & (s_end > s):
            offs_k = tl.arange(0, K)
            kk = _scaled(_tile(k_base, offs_n, skl, offs_k, n_ok, W, K, False), offs_k, DIV, OFFS, RANKS, TAUS, NL)
            dk = tl.zeros([BLOCK_N, K], dtype=tl.float32)
            while s < s_end:
                m_first = tl.load(segs_ptr + 2 * s)
                m_end = tl.load(segs_ptr + 2 * s + 1)
                if INTERPRET:
                    mt = m_first
                    while mt < m_end:
                        dk, dv = _dkdv_uniform(kk, vv, q_base, do_base, lse_base, delta_base, mt, sql, sdl, kl, offs_n,
                                               dk, dv, offs_k, offs_p, W, K, P, BLOCK_P, HAS_KEYLEN, DOT, BLOCK_M,
                                               BLOCK_N)
                        mt += 1
                else:
                    for mt in range(m_first, m_end):
                        dk, dv = _dkdv_uniform(kk, vv, q_base, do_base, lse_base, delta_base, mt, sql, sdl, kl, offs_n,
                                               dk, dv, offs_k, offs_p, W, K, P, BLOCK_P, HAS_KEYLEN, DOT, BLOCK_M,
                                               BLOCK_N)
                s += 1
            if W > 0:
                _add_to(dk_base, offs_n, n_ok, offs_k, W, H * E,
                        dk * (_col_scale(offs_k, OFFS, RANKS, TAUS, NL) / DIV)[None, :])
        return dv

    @triton.jit
    def _mlr_fwd_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, keylen_ptr, seg_ptr, segs_ptr, mix_ptr, mix_cols_ptr,
        L, H, n_tiles, sqb, sql, sqh, skb, skl, skh, svb, svl, svh, window, num_global,
        E: tl.constexpr, P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
        NL: tl.constexpr, NG: tl.constexpr, WG: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr,
        SIZES: tl.constexpr, TAUS: tl.constexpr, NCLS: tl.constexpr, CLS_W: tl.constexpr, CLS_K: tl.constexpr,
        CLS_DIV: tl.constexpr, CAUSAL: tl.constexpr, BANDED: tl.constexpr, HAS_KEYLEN: tl.constexpr,
        BLOCK_DIVIDE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        t, bh, b, h, kl = _program(n_tiles, H, L, keylen_ptr, CAUSAL, HAS_KEYLEN)
        q_base = q_ptr + b.to(tl.int64) * sqb + h * sqh
        k_base = k_ptr + b.to(tl.int64) * skb + h * skh
        v_base = v_ptr + b.to(tl.int64) * svb + h * svh
        m_lo, m_hi, offs_m, m_ok = _span(t, BLOCK_M, L)
        offs_p = tl.arange(0, BLOCK_P)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        # uniform pairs, class by class: one unmasked dot of the class's width per tile pair
        for c in tl.static_range(NCLS):
            m_i, l_i, acc = _fwd_class(q_base, k_base, v_base, seg_ptr + t * NCLS + c, segs_ptr, offs_m, m_ok, sql,
                                       skl, svl, kl, m_i, l_i, acc, offs_p, CLS_W[c], CLS_K[c], CLS_DIV[c], E, P,
                                       BLOCK_P, OFFS, RANKS, TAUS, NL, HAS_KEYLEN, DOT, BLOCK_M, BLOCK_N)
        # mixed pairs: every level masked per entry, and the causal, band, padding and tail masks
        i = tl.load(mix_ptr + t)
        i_end = tl.load(mix_ptr + t + 1)
        if i_end > i:
            offs_e = tl.arange(0, BLOCK_E)
            qf = _scaled(_tile(q_base, offs_m, sql, offs_e, m_ok, E, BLOCK_E, False), offs_e, 1.0, OFFS, RANKS, TAUS,
                         NL)
            while i < i_end:
                n_lo, n_hi, offs_n, n_ok = _span(tl.load(mix_cols_ptr + i), BLOCK_N, L)
                kf = _tile(k_base, offs_n, skl, offs_e, n_ok, E, BLOCK_E, False)
                S = _mixed_scores(qf, kf, offs_m, m_lo, m_hi, offs_n, n_lo, n_hi, offs_e, NL, NG, WG, OFFS, RANKS,
                                  SIZES, DOT)
                if BLOCK_DIVIDE:
                    S = S / _shared_levels(offs_m, offs_n, NL, NG, SIZES)
                ok = _allowed(offs_m[:, None], offs_n[None, :], L, kl, window, num_global, CAUSAL, BANDED,
                              HAS_KEYLEN)
                vv = _tile(v_base, offs_n, svl, offs_p, n_ok, P, BLOCK_P, False)
                m_i, l_i, acc = _softmax_step(tl.where(ok, S, float("-inf")), vv, m_i, l_i, acc, DOT)
                i += 1
        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        o_ptrs = o_ptr + ((b.to(tl.int64) * L + offs_m[:, None]) * H + h) * P + offs_p[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_p < P)[None, :])
        # base 2; +inf for a row with no allowed key (its probabilities are then 0 in the backward)
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("inf"))
        tl.store(lse_ptr + bh.to(tl.int64) * L + offs_m, lse, mask=m_ok)

    @triton.jit
    def _mlr_bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, keylen_ptr, dq_ptr, seg_ptr, segs_ptr, mix_ptr,
        mix_cols_ptr, L, H, n_tiles, sqb, sql, sqh, skb, skl, skh, svb, svl, svh, sdb, sdl, sdh, window, num_global,
        E: tl.constexpr, P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
        NL: tl.constexpr, NG: tl.constexpr, WG: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr,
        SIZES: tl.constexpr, TAUS: tl.constexpr, NCLS: tl.constexpr, CLS_W: tl.constexpr, CLS_K: tl.constexpr,
        CLS_DIV: tl.constexpr, CAUSAL: tl.constexpr, BANDED: tl.constexpr, HAS_KEYLEN: tl.constexpr,
        BLOCK_DIVIDE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        t, bh, b, h, kl = _program(n_tiles, H, L, keylen_ptr, CAUSAL, HAS_KEYLEN)
        q_base = q_ptr + b.to(tl.int64) * sqb + h * sqh
        k_base = k_ptr + b.to(tl.int64) * skb + h * skh
        v_base = v_ptr + b.to(tl.int64) * svb + h * svh
        do_base = do_ptr + b.to(tl.int64) * sdb + h * sdh
        dq_base = dq_ptr + (b.to(tl.int64) * L * H + h) * E
        m_lo, m_hi, offs_m, m_ok = _span(t, BLOCK_M, L)
        offs_p = tl.arange(0, BLOCK_P)
        do = _tile(do_base, offs_m, sdl, offs_p, m_ok, P, BLOCK_P, False)
        lse = tl.load(lse_ptr + bh.to(tl.int64) * L + offs_m, mask=m_ok, other=float("inf"))
        delta = tl.load(delta_ptr + bh.to(tl.int64) * L + offs_m, mask=m_ok, other=0.0)
        for c in tl.static_range(NCLS):
            _dq_class(q_base, k_base, v_base, dq_base, seg_ptr + t * NCLS + c, segs_ptr, do, lse, delta, offs_m,
                      m_ok, sql, skl, svl, kl, H, offs_p, CLS_W[c], CLS_K[c], CLS_DIV[c], E, P, BLOCK_P, OFFS, RANKS,
                      TAUS, NL, HAS_KEYLEN, DOT, BLOCK_M, BLOCK_N)
        i = tl.load(mix_ptr + t)
        i_end = tl.load(mix_ptr + t + 1)
        if i_end > i:
            offs_e = tl.arange(0, BLOCK_E)
            col_tau = _col_scale(offs_e, OFFS, RANKS, TAUS, NL)
            qf = _tile(q_base, offs_m, sql, offs_e, m_ok, E, BLOCK_E, False)
            qf = (qf.to(tl.float32) * (col_tau * 1.4426950408889634)[None, :]).to(q_ptr.dtype.element_ty)
            dq = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
            while i < i_end:
                n_lo, n_hi, offs_n, n_ok = _span(tl.load(mix_cols_ptr + i), BLOCK_N, L)
                kf = _tile(k_base, offs_n, skl, offs_e, n_ok, E, BLOCK_E, False)
                vv = _tile(v_base, offs_n, svl, offs_p, n_ok, P, BLOCK_P, False)
                S = _mixed_scores(qf, kf, offs_m, m_lo, m_hi, offs_n, n_lo, n_hi, offs_e, NL, NG, WG, OFFS, RANKS,
                                  SIZES, DOT)
                inv = tl.full([BLOCK_M, BLOCK_N], 1.0, dtype=tl.float32)
                if BLOCK_DIVIDE:
                    inv = 1.0 / _shared_levels(offs_m, offs_n, NL, NG, SIZES)
                ok = _allowed(offs_m[:, None], offs_n[None, :], L, kl, window, num_global, CAUSAL, BANDED,
                              HAS_KEYLEN)
                p = tl.where(ok, tl.math.exp2(S * inv - lse[:, None]), 0.0)
                dp = _dot(do, tl.trans(vv), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT)
                ds = p * (dp - delta[:, None]) * inv
                dq = _mixed_grads(ds, kf, dq, offs_m, m_lo, m_hi, offs_n, n_lo, n_hi, offs_e, NL, NG, WG, OFFS,
                                  RANKS, SIZES, DOT)
                i += 1
            _add_to(dq_base, offs_m, m_ok, offs_e, E, H * E, dq * col_tau[None, :])

    @triton.jit
    def _mlr_bwd_dkdv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, keylen_ptr, dk_ptr, dv_ptr, seg_ptr, segs_ptr, mix_ptr,
        mix_cols_ptr, L, H, n_tiles, sqb, sql, sqh, skb, skl, skh, svb, svl, svh, sdb, sdl, sdh, window, num_global,
        E: tl.constexpr, P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
        NL: tl.constexpr, NG: tl.constexpr, WG: tl.constexpr, OFFS: tl.constexpr, RANKS: tl.constexpr,
        SIZES: tl.constexpr, TAUS: tl.constexpr, NCLS: tl.constexpr, CLS_W: tl.constexpr, CLS_K: tl.constexpr,
        CLS_DIV: tl.constexpr, CAUSAL: tl.constexpr, BANDED: tl.constexpr, HAS_KEYLEN: tl.constexpr,
        BLOCK_DIVIDE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # rows: key tiles of BLOCK_N; columns: query tiles of BLOCK_M (the plan has keys_are_rows)
        t, bh, b, h, kl = _program(n_tiles, H, L, keylen_ptr, False, HAS_KEYLEN)
        q_base = q_ptr + b.to(tl.int64) * sqb + h * sqh
        k_base = k_ptr + b.to(tl.int64) * skb + h * skh
        v_base = v_ptr + b.to(tl.int64) * svb + h * svh
        do_base = do_ptr + b.to(tl.int64) * sdb + h * sdh
        dk_base = dk_ptr + (b.to(tl.int64) * L * H + h) * E
        lse_base = lse_ptr + bh.to(tl.int64) * L
        delta_base = delta_ptr + bh.to(tl.int64) * L
        n_lo, n_hi, offs_n, n_ok = _span(t, BLOCK_N, L)
        offs_p = tl.arange(0, BLOCK_P)
        live = n_lo < kl  # a key tile of pads only: no gradient, nothing to visit
        vv = _tile(v_base, offs_n, svl, offs_p, n_ok, P, BLOCK_P, False)
        dv = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
        for c in tl.static_range(NCLS):
            dv = _dkdv_class(q_base, k_base, vv, do_base, dk_base, lse_base, delta_base, seg_ptr + t * NCLS + c,
                             segs_ptr, live, offs_n, n_ok, sql, skl, sdl, kl, H, dv, offs_p, CLS_W[c], CLS_K[c],
                             CLS_DIV[c], E, P, BLOCK_P, OFFS, RANKS, TAUS, NL, HAS_KEYLEN, DOT, BLOCK_M, BLOCK_N)
        i = tl.load(mix_ptr + t)
        i_end = tl.load(mix_ptr + t + 1)
        if live & (i_end > i):
            offs_e = tl.arange(0, BLOCK_E)
            col_tau = _col_scale(offs_e, OFFS, RANKS, TAUS, NL)
            kf = _tile(k_base, offs_n, skl, offs_e, n_ok, E, BLOCK_E, False)
            kf = (kf.to(tl.float32) * (col_tau * 1.4426950408889634)[None, :]).to(k_ptr.dtype.element_ty)
            dk = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
            while i < i_end:
                m_lo, m_hi, offs_m, m_ok = _span(tl.load(mix_cols_ptr + i), BLOCK_M, L)
                qf = _tile(q_base, offs_m, sql, offs_e, m_ok, E, BLOCK_E, False)
                do = _tile(do_base, offs_m, sdl, offs_p, m_ok, P, BLOCK_P, False)
                lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
                delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
                St = _mixed_scores(kf, qf, offs_n, n_lo, n_hi, offs_m, m_lo, m_hi, offs_e, NL, NG, WG, OFFS, RANKS,
                                   SIZES, DOT)
                inv = tl.full([BLOCK_N, BLOCK_M], 1.0, dtype=tl.float32)
                if BLOCK_DIVIDE:
                    inv = 1.0 / _shared_levels(offs_n, offs_m, NL, NG, SIZES)
                ok = _allowed(offs_m[None, :], offs_n[:, None], L, kl, window, num_global, CAUSAL, BANDED,
                              HAS_KEYLEN)
                pt = tl.where(ok, tl.math.exp2(St * inv - lse[None, :]), 0.0)
                dv = _dot(pt.to(vv.dtype), do, dv, DOT)
                dpt = _dot(vv, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT)
                dst = pt * (dpt - delta[None, :]) * inv
                dk = _mixed_grads(dst, qf, dk, offs_n, n_lo, n_hi, offs_m, m_lo, m_hi, offs_e, NL, NG, WG, OFFS,
                                  RANKS, SIZES, DOT)
                i += 1
            _add_to(dk_base, offs_n, n_ok, offs_e, E, H * E, dk * col_tau[None, :])
        dv_ptrs = dv_ptr + ((b.to(tl.int64) * L + offs_n[:, None]) * H + h) * P + offs_p[None, :]
        tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_p < P)[None, :])


@dataclasses.dataclass(frozen=True)
class MLRSpec:
    """What the kernels are specialized on besides dtypes, widths and tiles. ``sizes``: tokens per block of each
    level, 0 = global; ``taus``: each level's logit scale; ``window`` (not None): the band of local attention, with
    ``num_global`` global tokens."""

    ranks: tuple[int, ...]
    sizes: tuple[int, ...]
    taus: tuple[float, ...]
    block_divide: bool = True
    causal: bool = False
    window: Optional[int] = None
    num_global: int = 0

    def block_sizes(self) -> list[Optional[int]]:
        return [None if s == 0 else s for s in self.sizes]


@dataclasses.dataclass(frozen=True)
class Tiles:
    """(rows, columns, warps, pipeline stages) of the three kernels. The forward and dq kernels hold query rows and
    stream key columns; the dk/dv kernel holds key rows and streams query columns."""

    forward: tuple[int, int, int, int]
    dq: tuple[int, int, int, int]
    dkdv: tuple[int, int, int, int]

    @staticmethod
    def default(dtype: torch.dtype, head_width: int) -> Tiles:
        """The GPU tiles: free of register spills at sm_90 with Triton 3.5 and 3.6 (``benchmarks/gpu/compile_check.py``)
        for half precision at head widths up to 64 (one level up to 128) and float32 up to 64. The dk/dv kernel
        streams 16 query columns where it holds the widest accumulators (at 32, Triton 3.6 spills there)."""
        if dtype == torch.float32:
            if head_width > 64:
                return Tiles(forward=(128, 32, 8, 2), dq=(64, 16, 8, 2), dkdv=(64, 16, 8, 2))
            return Tiles(forward=(128, 64, 8, 2), dq=(128, 32, 8, 2), dkdv=(128, 16, 8, 2))
        if head_width > 64:
            return Tiles(forward=(128, 32, 8, 2), dq=(64, 32, 8, 2), dkdv=(64, 16, 8, 2))
        return Tiles(forward=(128, 64, 8, 3), dq=(128, 32, 8, 2), dkdv=(128, 32, 8, 2))

    @staticmethod
    def uniform(size: int | None) -> Tiles | None:
        """Every kernel with square tiles of at least ``size`` tokens (a power of two, at least 16 on GPUs for
        ``tl.dot``), 4 warps, 2 stages: the interpreter tests use tiny ones. None for None (the defaults)."""
        if size is None:
            return None
        size = max(1 if _INTERPRET_AT_IMPORT else 16, pow2(size))
        return Tiles(forward=(size, size, 4, 2), dq=(size, size, 4, 2), dkdv=(size, size, 4, 2))


@functools.lru_cache(maxsize=128)
def _constants(spec: MLRSpec, e: int, p: int) -> dict[str, Any]:
    """The kernels' compile-time arguments for ``spec`` at head widths ``e`` (q, k) and ``p`` (v)."""
    n = len(spec.ranks)
    widths = [0] + [sum(spec.ranks[: m + 1]) for m in range(n)]
    classes = tile_classes(spec.block_sizes())
    num_global = next((i for i, s in enumerate(spec.sizes) if s != 0), n)
    return dict(
        E=e, P=p, BLOCK_E=max(16, pow2(e)), BLOCK_P=max(16, pow2(p)), NL=n, NG=num_global, WG=widths[num_global],
        OFFS=tuple(widths[:n]), RANKS=tuple(spec.ranks), SIZES=tuple(spec.sizes),
        TAUS=tuple(float(t) for t in spec.taus), NCLS=len(classes), CLS_W=tuple(widths[c] for c in classes),
        CLS_K=tuple(max(16, pow2(widths[c])) for c in classes),
        CLS_DIV=tuple(float(c) if spec.block_divide and c else 1.0 for c in classes),
        CAUSAL=bool(spec.causal), BANDED=spec.window is not None, BLOCK_DIVIDE=bool(spec.block_divide))


@functools.lru_cache(maxsize=64)
def _plan(spec: MLRSpec, length: int, rows: int, cols: int, keys_are_rows: bool,
          device: torch.device) -> tuple[int, tuple[Tensor, ...]]:
    """The tile plan's row count and its four index tensors on ``device`` (each a valid pointer, even if empty)."""
    plan = tile_plan(length, rows, cols, spec.block_sizes(), causal=spec.causal, keys_are_rows=keys_are_rows,
                     window=spec.window, num_global=spec.num_global)
    segs = plan.segs if plan.segs.numel() else plan.seg_ptr
    mixed = plan.mixed if plan.mixed.numel() else plan.mixed_ptr
    return plan.n_rows, tuple(t.to(device) for t in (plan.seg_ptr, segs, plan.mixed_ptr, mixed))


def _launch(kernel, tensors: tuple[Tensor, ...], strides: tuple[int, ...], spec: MLRSpec, tile: tuple[int, ...],
            keys_are_rows: bool, key_len: Tensor | None) -> None:
    """Launch one of the kernels on (b, L, H, E) ``tensors[0]`` with ``tile`` (rows, columns, warps, stages)."""
    q, v = tensors[0], tensors[2]
    b, L, H, E = q.shape
    rows, cols, warps, stages = tile
    n_rows, plan = _plan(spec, L, rows, cols, keys_are_rows, q.device)
    block_m, block_n = (cols, rows) if keys_are_rows else (rows, cols)
    with on_device(q.device):
        kernel[grid_1d(n_rows * b * H, "mlr attention")](
            *tensors, *plan, L, H, n_rows, *strides, 0 if spec.window is None else int(spec.window),
            int(spec.num_global), **_constants(spec, E, v.shape[-1]), HAS_KEYLEN=key_len is not None,
            DOT=dot_precision_split(v.dtype), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def _strides(*ts: Tensor) -> tuple[int, ...]:
    return tuple(s for t in ts for s in t.stride()[:3])


def mlr_forward(q: Tensor, k: Tensor, v: Tensor, key_len: Tensor | None, spec: MLRSpec,
                tiles: Tiles) -> tuple[Tensor, Tensor]:
    """Output (b, L, H, P) in v's dtype and the row log-sum-exp in base 2, (b * H, L) float32 (+inf for a row with
    no allowed key)."""
    b, L, H, _ = q.shape
    o = torch.empty(b, L, H, v.shape[-1], dtype=v.dtype, device=v.device)
    lse = torch.empty(b * H, L, dtype=torch.float32, device=v.device)
    _launch(_mlr_fwd_kernel, (q, k, v, o, lse, lse if key_len is None else key_len), _strides(q, k, v), spec,
            tiles.forward, False, key_len)
    return o, lse


def mlr_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, key_len: Tensor | None, o: Tensor, lse: Tensor,
                 spec: MLRSpec, tiles: Tiles) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of :func:`mlr_forward` in the inputs' dtypes."""
    b, L, H, _ = q.shape
    do = _rows_last(do)
    if row_span(do) >= MAX_ROW_SPAN:  # a gradient arriving as a narrow view of a wider tensor
        do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).reshape(b * H, L).contiguous()  # D_i = dO_i . O_i
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros_like(dq)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    inputs = (q, k, v, do, lse, delta, lse if key_len is None else key_len)
    strides = _strides(q, k, v, do)
    _launch(_mlr_bwd_dq_kernel, (*inputs, dq), strides, spec, tiles.dq, False, key_len)
    _launch(_mlr_bwd_dkdv_kernel, (*inputs, dk, dv), strides, spec, tiles.dkdv, True, key_len)
    return dq.to(q.dtype), dk.to(k.dtype), dv


class _MLRFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_len, spec: MLRSpec, tiles: Tiles):
        o, lse = mlr_forward(q, k, v, key_len, spec, tiles)
        ctx.save_for_backward(q, k, v, key_len, o, lse)
        ctx.spec, ctx.tiles = spec, tiles
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, key_len, o, lse = ctx.saved_tensors
        dq, dk, dv = mlr_backward(do, q, k, v, key_len, o, lse, ctx.spec, ctx.tiles)
        return dq, dk, dv, None, None, None


def _key_lengths(mask: Tensor | None) -> Tensor | None:
    """Per row, the number of real keys of a right-padded mask (a row with no real token keeps every key), int32."""
    if mask is None:
        return None
    lengths = mask.sum(dim=1)
    return torch.where(lengths == 0, mask.shape[1], lengths).to(torch.int32).contiguous()


def mlr_triton(q: Tensor, k: Tensor, v: Tensor, spec: MLRSpec, *, mask: Tensor | None = None,
               tiles: Tiles | None = None) -> Tensor:
    """The kernels on (b, L, H, e) q, k and (b, L, H, p) v of one dtype (float32, bfloat16 or float16; any strides
    with unit feature stride), differentiable in all three: ``softmax(S + masks) v`` in v's dtype. ``mask``: bool
    (b, L), True on real tokens, right-padded (pad keys are excluded; pad outputs are not zeroed, the caller does
    that). ``tiles``: None = :meth:`Tiles.default`."""
    span = row_span(q, k, v)
    if span >= MAX_ROW_SPAN:
        raise ValueError(f"the Triton attention kernels index a batch's slice in 32 bits: its span is {span} >= 2^31 "
                         f"elements; run this call on the torch backend (backend='torch')")
    require(q.device, "MLR attention")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"the Triton MLR kernels take float32, bfloat16 or float16 inputs of one dtype; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if tiles is None:
        tiles = Tiles.default(q.dtype, max(q.shape[-1], v.shape[-1]))
    return _MLRFunction.apply(_rows_last(q), _rows_last(k), _rows_last(v), _key_lengths(mask), spec, tiles)


def mlr_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, ranks: Sequence[int], block_sizes: Sequence[Optional[int]],
    level_scales: Sequence[float], *, block_divide: bool = True, causal: bool = False, mask: Tensor | None = None,
    tile_size: int | None = None,
) -> Tensor:
    """MLR attention ``softmax(S + masks) v`` without materializing ``S``; differentiable in q, k, v.

    q, k (b, l, h, e) with ``sum(ranks) == e`` (level l = the next ``ranks[l]`` features); v (b, l, h, p);
    ``block_sizes[l]`` tokens per level-l block (None = global; blocks aligned at 0; nested, coarse first, as the
    op validates); ``level_scales[l]`` = tau_l; ``mask`` bool (b, l), True on real tokens, right padding (pad keys
    are excluded; a row with no real token keeps all keys). ``tile_size``: :meth:`Tiles.uniform` (None: the
    defaults). Returns (b, l, h, p) in v's dtype (pad outputs are not zeroed: the op does that).
    """
    e = q.shape[-1]
    if sum(ranks) != e or len(ranks) != len(block_sizes) or len(ranks) != len(level_scales):
        raise ValueError(f"ranks {list(ranks)} must sum to the q/k width {e} and match block_sizes/level_scales")
    spec = MLRSpec(tuple(int(r) for r in ranks), tuple(0 if s is None else int(s) for s in block_sizes),
                   tuple(float(s) for s in level_scales), bool(block_divide), bool(causal))
    return mlr_triton(q, k, v, spec, mask=mask, tiles=Tiles.uniform(tile_size))
