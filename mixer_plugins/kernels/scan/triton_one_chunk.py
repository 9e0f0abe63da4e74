"""The scan of a sequence that is one chunk (at most a few hundred tokens, e.g. a ViT's 197), in Triton, with no
states at all: flash-style tiles over the keys with both directions' decays, the shift and the diagonal.

The sequence is cut into tiles of :data:`TILE` rows (the last one partial). The kernels keep what the chunked kernels
keep per chunk: the prepared step sizes and their log decays ``a = A dt`` per token; every log decay is a sum of ``a``
over its own span, from pieces that all have the sign of the whole, each a cumsum that starts at its own edge (see
:mod:`.triton_kernels`). Between a query row ``i`` of tile m and a key row ``j`` of tile n:

* n = m: as inside a chunk, a masked cumsum per pair (:func:`.triton_kernels._pair_logs`);
* forward, n < m: ``read_i + (sum of a over the tiles strictly between) + own_j``, ``read_i = a`` from tile m's first
  row to row ``i`` (``i - 1`` shifted), ``own_j = a`` after row ``j`` to tile n's last;
* backward, n > m: the mirror: ``read_i`` from row ``i`` (``i + 1`` shifted) to tile m's last, ``own_j`` from tile
  n's first row to row ``j - 1``.

So the decay between neighbours is exactly 1 across a tile boundary too, and the precision is the chunked kernels'.
The log-decay gradient likewise takes each term once (:func:`_dx_kernel`): the diagonal tile pairs' ``dLoss/dL_ij``
from ``dy x^T``, the other tile pairs' row sums on the query side and on the key side, and their totals on the tiles
strictly between.

Launches (each kernel's docstring says what its programs do): forward, 2: ``_prep_kernel`` (per sequence, group and
query tile), ``_out_kernel`` (per sequence, head and query tile); backward, 3 (+ one small sum of per-tile partials
of dA and d dt_bias), each over many programs so that a ViT's step fills the GPU, with no atomics (every output
written by one program, every sum in a fixed order): ``_dx_kernel`` (per sequence, head and tile), ``_dcb_kernel``
(per sequence, group, query tile and block of the group's heads: :meth:`OneChunkGeometry.head_blocks`),
``_dbc_kernel`` (per sequence, group, tile and which of dB or dC). A ViT-B step (batch 64, 197 tokens in 4 tiles, 24
heads, 1 group) runs 6,144 + 512 + 512 programs (two head blocks). The tile walks are ``while`` loops: the 3.5
interpreter's ``range()`` cannot take a bound computed from the program id.

Every grid is one-dimensional and every offset of a whole tensor 64-bit (see :mod:`.triton_kernels`). Run on CUDA, or
on CPU tensors with ``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._triton._common import cdiv, dot_precision, grid_1d, on_device, pow2, tl, triton
from .._triton._common import mm as _mm
from . import triton_kernels as _chunked

__all__ = ["LAUNCH", "TILE", "OneChunkGeometry", "scan_one_chunk", "scan_one_chunk_flops"]

#: rows of a tile (queries or keys); a shorter sequence is one tile of its length rounded up to a power of two (>= 16)
TILE = 64

#: Triton launch options of each kernel (see :data:`.triton_kernels.LAUNCH`)
LAUNCH: dict[str, dict[str, int]] = {
    "prep": {"num_warps": 8, "num_stages": 1}, "out": {"num_warps": 8, "num_stages": 1},
    "dx": {"num_warps": 8, "num_stages": 1}, "dcb": {"num_warps": 8, "num_stages": 1},
    "dbc": {"num_warps": 8, "num_stages": 1},
}

#: the backward's ``d(C~ B^T)`` launch splits a group's heads into blocks until it has at least this many programs
#: (at most :data:`MAX_HEAD_BLOCKS` blocks: each block adds a slab of partial sums the next launch reads)
MIN_PROGRAMS = 512
MAX_HEAD_BLOCKS = 8


class OneChunkGeometry:
    """Tiles, block sizes and the one-dimensional launch grids of one scan on the one-chunk kernels (pure Python)."""

    def __init__(self, batch: int, length: int, heads: int, groups: int, head_dim: int, state: int,
                 tile: int | None = None):
        self.batch, self.length, self.heads, self.groups = int(batch), int(length), int(heads), int(groups)
        self.head_dim, self.state = int(head_dim), int(state)
        self.tile = min(int(tile or TILE), max(16, pow2(self.length)))
        self.ntiles = cdiv(self.length, self.tile)

    def blocks(self, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, Any]]:
        """The block sizes of the kernels that tile the head dimension, and of those that tile the state."""
        bp, bn = max(16, pow2(self.head_dim)), max(16, pow2(self.state))
        common = dict(BLOCK_T=self.tile, DOT=dot_precision(dtype))
        return dict(common, BLOCK_P=bp, EVEN_P=bp == self.head_dim), dict(common, BLOCK_N=bn, EVEN_N=bn == self.state)

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.batch, self.length, self.heads, self.groups, self.head_dim, self.state, self.ntiles)

    def tile_grid(self, per: int) -> tuple[int]:
        """One program per (sequence, ``per`` (heads or groups), tile)."""
        return grid_1d(self.batch * per * self.ntiles, "triton scan (one chunk)")

    def head_blocks(self) -> int:
        """Blocks of a group's heads in the ``d(C~ B^T)`` launch: the fewest (a divisor of the heads per group, at
        most :data:`MAX_HEAD_BLOCKS`) that give it :data:`MIN_PROGRAMS` programs."""
        per = self.heads // self.groups
        fits = [k for k in range(1, min(per, MAX_HEAD_BLOCKS) + 1) if per % k == 0]
        return next((k for k in fits if self.batch * self.groups * self.ntiles * k >= MIN_PROGRAMS), fits[-1])

    def grids(self) -> dict[str, tuple[int]]:
        """The backward's launch grids: ``dx`` per (sequence, head, tile), ``dcb`` per (sequence, group, tile, head
        block), ``dbc`` per (sequence, group, tile, dB or dC)."""
        return {"dx": self.tile_grid(self.heads), "dcb": self.tile_grid(self.groups * self.head_blocks()),
                "dbc": self.tile_grid(self.groups * 2)}


if triton is not None:
    _at, _tile, _store_tile, _decays, _c_rows = (_chunked._at, _chunked._tile, _chunked._store_tile,
                                                 _chunked._decays, _chunked._c_rows)
    _pick, _step, _store_dc, _intra_decay = _chunked._pick, _chunked._step, _chunked._store_dc, _chunked._intra_decay
    _rate = _chunked._rate
    _read_log_weight, _own_log_weight = _chunked._read_log_weight, _chunked._own_log_weight
    _dlog_pairs, _dlog_query, _dlog_key = _chunked._dlog_pairs, _chunked._dlog_query, _chunked._dlog_key

    @triton.jit
    def _between(dtc_ptr, plane, vrow, lo, hi, L, BLOCK_T: tl.constexpr):
        """Sum of ``a`` over the tiles strictly between ``lo`` and ``hi`` of the head and direction at ``vrow``, tile
        by tile (every term has the sign of the whole)."""
        offs = tl.arange(0, BLOCK_T)
        s = 0.0
        k = lo + 1
        while k < hi:
            rows = k * BLOCK_T + offs
            s += tl.sum(tl.load(dtc_ptr + plane + vrow + rows, mask=rows < L, other=0.0), 0)
            k += 1
        return s

    @triton.jit
    def _tile_logs(d: tl.constexpr, dtc_ptr, base, offs, ok, plane, SHIFT: tl.constexpr):
        """A tile's prepared step sizes ``dt`` and log decays ``a`` (one head, direction ``d``), its rows' log
        weights to the tile's edges, and its total: as query rows, ``read`` (``a`` from the tile's edge on the keys'
        side to the row, :func:`.triton_kernels._read_log_weight`); as key rows, ``own`` (from the row, excluded, to
        the edge on the queries' side, :func:`.triton_kernels._own_log_weight`). Each is a one-sided sum."""
        dt, a = _decays(dtc_ptr, base, offs, ok, plane)
        return dt, a, _read_log_weight(d, a, SHIFT), _own_log_weight(d, a), tl.sum(a, 0)

    @triton.jit
    def _pair_decay(read_m, own_n, ok_m, ok_n, between):
        """Decays between the rows of query tile m and another key tile n of a direction's side (n < m forward,
        n > m backward): ``exp(read_i + between + own_j)``, the query row's and the key row's log weights to their
        tiles' edges (:func:`_tile_logs`) and ``between`` the totals of the tiles strictly between; 0 outside
        ``ok_m`` and ``ok_n``. (The pairs of one tile take :func:`.triton_kernels._intra_decay`.)"""
        qv = tl.where(ok_m, read_m, float("-inf"))
        kv = tl.where(ok_n, between + own_n, float("-inf"))
        return tl.exp(qv[:, None] + kv[None, :])

    @triton.jit
    def _prep_kernel(
        dtf_ptr, Af_ptr, Bf_ptr, Cf_ptr, dtb_ptr, Ab_ptr, Bb_ptr, Cb_ptr, sdb, sdl, sdh, sbb, sbl, sbg,
        bias_ptr, cb_ptr, dtc_ptr, BATCH, L, H, G, P, N, NT, lo, hi,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
        CLAMP: tl.constexpr, A_LOG: tl.constexpr, SHIFT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
        EVEN_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, group, query tile m): ``C~_m B_n^T`` for every key tile n of each direction's side (n <= m
        forward, n >= m backward), once per group; then head by head the prepared step sizes of tile m and their log
        decays ``a = A dt``."""
        pid = tl.program_id(0).to(tl.int64)
        m = pid % NT
        g = (pid // NT) % G
        b = pid // NT // G
        t0 = m * BLOCK_T
        rem = (L - t0).to(tl.int32)
        offs = tl.arange(0, BLOCK_T)
        offs_n = tl.arange(0, BLOCK_N)
        ok = offs < rem
        plane = (D1 - D0) * BATCH * H * L
        for d in tl.static_range(D0, D1):
            slot = d - D0
            rc, c_ok = _c_rows(d, offs, ok, t0, rem, SHIFT)
            Ct = _tile(_at(_pick(d, Cf_ptr, Cb_ptr), b, t0, g, sbb, sbl, sbg), rc, c_ok, offs_n, N, sbl, EVEN_N)
            n, count = _span(m, NT, d == 0)   # m's key tiles: up to it forward, from it backward
            n_end = n + count
            while n < n_end:
                s0 = n * BLOCK_T
                Bt = _tile(_at(_pick(d, Bf_ptr, Bb_ptr), b, s0, g, sbb, sbl, sbg), offs, offs < (L - s0).to(tl.int32),
                           offs_n, N, sbl, EVEN_N)
                cbp = cb_ptr + ((((slot * BATCH + b) * G + g) * NT + m) * NT + n) * BLOCK_T * BLOCK_T
                tl.store(cbp + offs[:, None] * BLOCK_T + offs[None, :], _mm(Ct, tl.trans(Bt), DOT))
                n += 1
            A_ptr = _pick(d, Af_ptr, Ab_ptr)
            dt_ptr = _pick(d, dtf_ptr, dtb_ptr)
            for hh in range(HG):
                h = g * HG + hh
                dt, unused = _step(_at(dt_ptr, b, t0, h, sdb, sdl, sdh), offs, ok, sdl, bias_ptr, h, lo, hi,
                                   HAS_BIAS, SOFTPLUS, CLAMP)
                vbase = ((slot * BATCH + b) * H + h) * L + t0
                tl.store(dtc_ptr + vbase + offs, dt, mask=ok)
                tl.store(dtc_ptr + plane + vbase + offs, dt * _rate(A_ptr, h, A_LOG), mask=ok)

    @triton.jit
    def _sweep_keys(acc, d: tl.constexpr, m, read_m, ok, seg_m, b, h, g, slot, vrow, L, NT, BATCH, G, plane,
                    dtc_ptr, seg_ptr, cb_ptr, x_ptr, sxb, sxl, sxh, offs, offs_p, P, HAS_SEG: tl.constexpr,
                    SHIFT: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_P: tl.constexpr, DOT: tl.constexpr):
        """``acc + sum_n M_mn x_n`` over direction ``d``'s key tiles, from the diagonal tile ``m`` outwards (down for
        the forward side, up for the backward one), the decay between tiles carried along (``seg_m``: the query
        tile's segment ids, read only with ``HAS_SEG``)."""
        between = 0.0
        n = m
        while (n >= 0) & (n < NT):
            s0 = n * BLOCK_T
            rem_n = (L - s0).to(tl.int32)
            okn = offs < rem_n
            dt_n, a_n, read_n, own_n, tot_n = _tile_logs(d, dtc_ptr, vrow + s0, offs, okn, plane, SHIFT)
            if n == m:
                decay = _intra_decay(d, a_n, okn, SHIFT)
            else:
                decay = _pair_decay(read_m, own_n, ok, okn, between)
            if HAS_SEG:
                seg_n = tl.load(seg_ptr + b * L + s0 + tl.minimum(offs, rem_n - 1))
                decay = tl.where(seg_m[:, None] == seg_n[None, :], decay, 0.0)
            cbp = cb_ptr + ((((slot * BATCH + b) * G + g) * NT + m) * NT + n) * BLOCK_T * BLOCK_T
            M = tl.load(cbp + offs[:, None] * BLOCK_T + offs[None, :]) * decay * dt_n[None, :]
            xn = _tile(_at(x_ptr, b, s0, h, sxb, sxl, sxh), offs, okn, offs_p, P, sxl, EVEN_P)
            acc += _mm(M, xn, DOT)
            if n != m:
                between += tot_n
            n += _pick(d, -1, 1)
        return acc

    @triton.jit
    def _out_kernel(
        x_ptr, sxb, sxl, sxh, diag_ptr, sgb, sgl, sgh, seg_ptr, cb_ptr, dtc_ptr, y_ptr,
        BATCH, L, H, G, P, N, NT,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_SEG: tl.constexpr,
        SHIFT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, EVEN_P: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, head, query tile m): ``y_m = sum_n M_mn x_n + diag x_m`` over the key tiles of both
        directions' sides."""
        pid = tl.program_id(0).to(tl.int64)
        m = pid % NT
        h = (pid // NT) % H
        b = pid // NT // H
        g = h // HG
        t0 = m * BLOCK_T
        rem = (L - t0).to(tl.int32)
        offs = tl.arange(0, BLOCK_T)
        offs_p = tl.arange(0, BLOCK_P)
        ok = offs < rem
        plane = (D1 - D0) * BATCH * H * L
        seg_m = offs  # the query tile's segment ids (with HAS_SEG)
        if HAS_SEG:
            seg_m = tl.load(seg_ptr + b * L + t0 + tl.minimum(offs, rem - 1))
        acc = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
        if HAS_DIAG:
            dg = tl.load(_at(diag_ptr, b, t0, h, sgb, sgl, sgh) + offs * sgl, mask=ok, other=0.0).to(tl.float32)
            x = _tile(_at(x_ptr, b, t0, h, sxb, sxl, sxh), offs, ok, offs_p, P, sxl, EVEN_P)
            acc += dg[:, None] * x.to(tl.float32)
        for d in tl.static_range(D0, D1):
            slot = d - D0
            vrow = ((slot * BATCH + b) * H + h) * L
            dt_m, a_m, read_m, own_m, tot_m = _tile_logs(d, dtc_ptr, vrow + t0, offs, ok, plane, SHIFT)
            acc = _sweep_keys(acc, d, m, read_m, ok, seg_m, b, h, g, slot, vrow, L, NT, BATCH, G, plane, dtc_ptr,
                              seg_ptr, cb_ptr, x_ptr, sxb, sxl, sxh, offs, offs_p, P, HAS_SEG, SHIFT, BLOCK_T, EVEN_P,
                              DOT)
        _store_tile(y_ptr + ((b * L + t0) * H + h) * P, offs, ok, offs_p, P, H * P, acc, EVEN_P)

    @triton.jit
    def _dcb_pair(
        x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, dtc_ptr, b, h0, m, n, slot, plane, BATCH, L, H, P,
        d: tl.constexpr, HPB: tl.constexpr, SHIFT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
        EVEN_P: tl.constexpr, DOT: tl.constexpr,
    ):
        """``d(C~ B^T)`` of one tile pair (query tile m, key tile n) of direction ``d``, summed over the ``HPB`` heads
        from ``h0``: ``sum_heads (dy_m x_n^T) * decay * dt_n``."""
        t0 = m * BLOCK_T
        s0 = n * BLOCK_T
        rem = (L - t0).to(tl.int32)
        rem_n = (L - s0).to(tl.int32)
        offs = tl.arange(0, BLOCK_T)
        offs_p = tl.arange(0, BLOCK_P)
        ok = offs < rem
        okn = offs < rem_n
        dCB = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)
        for hh in range(HPB):
            h = h0 + hh
            vrow = ((slot * BATCH + b) * H + h) * L
            dt_n, a_n, read_n, own_n, tot_n = _tile_logs(d, dtc_ptr, vrow + s0, offs, okn, plane, SHIFT)
            if n == m:
                decay = _intra_decay(d, a_n, okn, SHIFT)
            else:
                dt_m, a_m, read_m, own_m, tot_m = _tile_logs(d, dtc_ptr, vrow + t0, offs, ok, plane, SHIFT)
                between = _between(dtc_ptr, plane, vrow, _pick(d, n, m), _pick(d, m, n), L, BLOCK_T)
                decay = _pair_decay(read_m, own_n, ok, okn, between)
            dy = _tile(_at(dy_ptr, b, t0, h, syb, syl, syh), offs, ok, offs_p, P, syl, EVEN_P)
            xn = _tile(_at(x_ptr, b, s0, h, sxb, sxl, sxh), offs, okn, offs_p, P, sxl, EVEN_P)
            dCB += _mm(dy, tl.trans(xn), DOT) * decay * dt_n[None, :]
        return dCB

    @triton.jit
    def _step_grads(
        dtf_ptr, Af_ptr, dtb_ptr, Ab_ptr, sdb, sdl, sdh, bias_ptr, dtc_ptr, kq_ptr, tot_ptr, ddtf_ptr, ddtb_ptr,
        part_ptr, b, h, m, plane, BATCH, L, H, NT, lo, hi,
        D0: tl.constexpr, D1: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
        A_LOG: tl.constexpr, SHARED_A: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_NT: tl.constexpr,
    ):
        """One head's step-size gradients on query tile m: the log-decay gradient ``da`` of the tile's rows (the key
        rows' and the query rows' shares from ``kq``, and the totals ``tot`` of the tile pairs that straddle the
        tile), then ``(kd + A da)`` through the step sizes' preparation (dt's dtype), and the tile's partials of dA
        (or ``dA_log = A dA`` with ``A_LOG``) and d dt_bias (``part`` (batch * NT, 3, H))."""
        t0 = m * BLOCK_T
        offs = tl.arange(0, BLOCK_T)
        ok = offs < (L - t0).to(tl.int32)
        qi = tl.arange(0, BLOCK_NT)[:, None]
        ki = tl.arange(0, BLOCK_NT)[None, :]
        part = part_ptr + (b * NT + m) * 3 * H + h
        dbias = 0.0
        dA_both = 0.0
        for d in tl.static_range(D0, D1):
            slot = d - D0
            vrow = ((slot * BATCH + b) * H + h) * L
            # the tile pairs (query qi, key ki) whose span holds tile m
            if d == 0:
                straddle = (qi > m) & (qi < NT) & (ki < m)
            else:
                straddle = (qi < m) & (ki > m) & (ki < NT)
            tot = tot_ptr + ((slot * BATCH + b) * H + h) * NT * NT
            span = tl.sum(tl.sum(tl.load(tot + qi * NT + ki, mask=straddle, other=0.0), 1), 0)
            dt = tl.load(dtc_ptr + vrow + t0 + offs, mask=ok, other=0.0)
            kd = tl.load(kq_ptr + vrow + t0 + offs, mask=ok, other=0.0)
            da = (tl.load(kq_ptr + plane + vrow + t0 + offs, mask=ok, other=0.0) +
                  tl.load(kq_ptr + 2 * plane + vrow + t0 + offs, mask=ok, other=0.0) + span)
            da = tl.where(ok, da, 0.0)
            if HAS_BIAS or SOFTPLUS or CLAMP:
                unused, gdt = _step(_at(_pick(d, dtf_ptr, dtb_ptr), b, t0, h, sdb, sdl, sdh), offs, ok, sdl,
                                    bias_ptr, h, lo, hi, HAS_BIAS, SOFTPLUS, CLAMP)
            else:
                gdt = tl.where(ok, 1.0, 0.0)
            A = _rate(_pick(d, Af_ptr, Ab_ptr), h, A_LOG)
            ddt = (kd + A * da) * gdt
            ddt_ptr = _pick(d, ddtf_ptr, ddtb_ptr)
            tl.store(ddt_ptr + (b * L + t0) * H + h + offs * H, ddt.to(ddt_ptr.dtype.element_ty), mask=ok)
            dA = tl.sum(dt * da, 0)
            if A_LOG:
                dA *= A
            if SHARED_A:   # one A for both directions: one gradient
                dA_both += dA
            else:
                tl.store(part + d * H, dA)
            dbias += tl.sum(ddt, 0)
        if SHARED_A:
            tl.store(part, dA_both)
        if HAS_BIAS:
            tl.store(part + 2 * H, dbias)

    @triton.jit
    def _dcb_kernel(
        x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, dtf_ptr, Af_ptr, dtb_ptr, Ab_ptr, sdb, sdl, sdh, bias_ptr,
        seg_ptr, dtc_ptr, kq_ptr, tot_ptr, dcb_ptr, ddtf_ptr, ddtb_ptr, part_ptr, BATCH, L, H, G, P, N, NT, lo, hi,
        HG: tl.constexpr, HB: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_SEG: tl.constexpr,
        HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr, A_LOG: tl.constexpr,
        SHIFT: tl.constexpr, SHARED_A: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
        BLOCK_NT: tl.constexpr, EVEN_P: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, group, query tile m, block k of ``HG / HB`` of the group's heads), after
        :func:`_dx_kernel`:

        1. for each key tile n of each direction's side, the block's share of ``d(C~ B^T)_mn = sum_heads (dy_m
           x_n^T) * decay * dt_n``, kept in ``dcb`` (one slab per head block, summed by :func:`_dbc_kernel`);
        2. the block's heads' step-size gradients on tile m (:func:`_step_grads`)."""
        pid = tl.program_id(0).to(tl.int64)
        k = pid % HB
        m = (pid // HB) % NT
        g = (pid // HB // NT) % G
        b = pid // HB // NT // G
        HPB: tl.constexpr = HG // HB
        h0 = g * HG + k * HPB
        t0 = m * BLOCK_T
        rem = (L - t0).to(tl.int32)
        offs = tl.arange(0, BLOCK_T)
        plane = (D1 - D0) * BATCH * H * L
        if HAS_SEG:
            seg_m = tl.load(seg_ptr + b * L + t0 + tl.minimum(offs, rem - 1))
        for d in tl.static_range(D0, D1):
            slot = d - D0
            n_first, count = _span(m, NT, d == 0)   # m's key tiles: up to it forward, from it backward
            i = count * 0
            while i < count:
                n = n_first + i
                s0 = n * BLOCK_T
                dCB = _dcb_pair(x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, dtc_ptr, b, h0, m, n, slot, plane,
                                BATCH, L, H, P, d, HPB, SHIFT, BLOCK_T, BLOCK_P, EVEN_P, DOT)
                if HAS_SEG:
                    seg_n = tl.load(seg_ptr + b * L + s0 + tl.minimum(offs, (L - s0).to(tl.int32) - 1))
                    dCB = tl.where(seg_m[:, None] == seg_n[None, :], dCB, 0.0)
                pair = ((((k * (D1 - D0) + slot) * BATCH + b) * G + g) * NT + m) * NT + n
                dcbp = dcb_ptr + pair * BLOCK_T * BLOCK_T
                tl.store(dcbp + offs[:, None] * BLOCK_T + offs[None, :], dCB)
                i += 1
        for hh in range(HPB):
            _step_grads(dtf_ptr, Af_ptr, dtb_ptr, Ab_ptr, sdb, sdl, sdh, bias_ptr, dtc_ptr, kq_ptr, tot_ptr, ddtf_ptr,
                        ddtb_ptr, part_ptr, b, h0 + hh, m, plane, BATCH, L, H, NT, lo, hi, D0, D1, HAS_BIAS, SOFTPLUS,
                        CLAMP, A_LOG, SHARED_A, BLOCK_T, BLOCK_NT)

    @triton.jit
    def _span(t, NT, UP_TO: tl.constexpr):
        """Tiles ``0..t`` (``UP_TO``) or ``t..NT-1`` as ``(first, count)``: a query tile's key tiles are those up to it
        in the forward direction and from it in the backward one; a key tile's query tiles the other way round."""
        if UP_TO:
            first = t * 0
            count = t + 1
        else:
            first = t
            count = NT - t
        return first, count

    @triton.jit
    def _dcb_sum(dcb_ptr, k_stride, slot, b, g, m, n, BATCH, G, NT, HB: tl.constexpr, BLOCK_T: tl.constexpr):
        """``d(C~ B^T)_mn`` of one tile pair: the ``HB`` head blocks' shares (``k_stride`` elements apart) summed in
        a fixed order."""
        offs = tl.arange(0, BLOCK_T)
        p = dcb_ptr + ((((slot * BATCH + b) * G + g) * NT + m) * NT + n) * BLOCK_T * BLOCK_T
        p = p + offs[:, None] * BLOCK_T + offs[None, :]
        acc = tl.load(p)
        for k in range(1, HB):
            acc += tl.load(p + k * k_stride)
        return acc

    @triton.jit
    def _dbc_kernel(
        Bf_ptr, Cf_ptr, Bb_ptr, Cb_ptr, sbb, sbl, sbg, dcb_ptr, dBf_ptr, dBb_ptr, dCf_ptr, dCb_ptr,
        BATCH, L, G, N, NT,
        HB: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, SHIFT: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, group, tile t, which): ``which = 0``: ``dC~_t = sum_n d(C~ B^T)_tn B_n`` over the key tiles
        of each direction's side, stored as dC; ``which = 1``: ``dB_t = sum_m d(C~ B^T)_mt^T C~_m`` over the query
        tiles; each ``d(C~ B^T)`` the sum of its head blocks' shares (:func:`_dcb_sum`), in the generators' dtype."""
        pid = tl.program_id(0).to(tl.int64)
        which = pid % 2
        t = (pid // 2) % NT
        g = (pid // 2 // NT) % G
        b = pid // 2 // NT // G
        t0 = t * BLOCK_T
        rem = (L - t0).to(tl.int32)
        offs = tl.arange(0, BLOCK_T)
        offs_n = tl.arange(0, BLOCK_N)
        ok = offs < rem
        k_stride = (D1 - D0) * BATCH * G * NT * NT * BLOCK_T * BLOCK_T
        out_rows = ((b * L + t0) * G + g) * N
        for d in tl.static_range(D0, D1):
            slot = d - D0
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            if which == 0:
                # dC of query tile t: its key tiles n (n <= t forward, n >= t backward)
                first, count = _span(t, NT, d == 0)
                i = count * 0
                while i < count:
                    n = first + i
                    s0 = n * BLOCK_T
                    Bn = _tile(_at(_pick(d, Bf_ptr, Bb_ptr), b, s0, g, sbb, sbl, sbg), offs,
                               offs < (L - s0).to(tl.int32), offs_n, N, sbl, EVEN_N)
                    dCB = _dcb_sum(dcb_ptr, k_stride, slot, b, g, t, n, BATCH, G, NT, HB, BLOCK_T)
                    acc += _mm(dCB, Bn, DOT)
                    i += 1
                rc, c_ok = _c_rows(d, offs, ok, t0, rem, SHIFT)
                _store_dc(_pick(d, dCf_ptr, dCb_ptr) + out_rows, acc, rc, c_ok, d, t, NT, rem, N, G * N, SHIFT,
                          BLOCK_T, BLOCK_N, EVEN_N)
            else:
                # dB of key tile t: its query tiles m (m >= t forward, m <= t backward)
                first, count = _span(t, NT, d == 1)
                i = count * 0
                while i < count:
                    m = first + i
                    q0 = m * BLOCK_T
                    rem_m = (L - q0).to(tl.int32)
                    rc, c_ok = _c_rows(d, offs, offs < rem_m, q0, rem_m, SHIFT)
                    Cm = _tile(_at(_pick(d, Cf_ptr, Cb_ptr), b, q0, g, sbb, sbl, sbg), rc, c_ok, offs_n, N, sbl,
                               EVEN_N)
                    dCB = _dcb_sum(dcb_ptr, k_stride, slot, b, g, m, t, BATCH, G, NT, HB, BLOCK_T)
                    acc += _mm(tl.trans(dCB), Cm, DOT)
                    i += 1
                _store_tile(_pick(d, dBf_ptr, dBb_ptr) + out_rows, offs, ok, offs_n, N, G * N, acc, EVEN_N)

    @triton.jit
    def _dx_key_tile(
        x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, diag_ptr, sgb, sgl, sgh, seg_ptr, cb_ptr, dtc_ptr, kq_ptr,
        dx_ptr, ddiag_ptr, b, h, g, n, plane, BATCH, L, H, G, P, NT,
        D0: tl.constexpr, D1: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_SEG: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, EVEN_P: tl.constexpr, DOT: tl.constexpr,
    ):
        """:func:`_dx_kernel`'s key tile n: ``dx_n``, ``kd`` and the key rows' share of the log-decay gradient. Per
        direction: first the other query tiles of the direction's side, from the nearest outwards (the decay between
        tiles carried along), ``Z_n = sum_{m != n} M~_mn^T dy_m``, whose ``kx_j = dt_j x_j . Z_j`` (pairs whose query
        lies beyond tile n) gives the tile rows' ``da`` on the keys' side (:func:`.triton_kernels._dlog_key`, into
        ``kq + plane``); then the diagonal tile's ``M~_nn^T dy_n`` is added, ``dx_n += dt_n Z_n`` and ``kd_j = x_j .
        Z_j`` (into ``kq``)."""
        offs = tl.arange(0, BLOCK_T)
        offs_p = tl.arange(0, BLOCK_P)
        s0 = n * BLOCK_T
        rem_n = (L - s0).to(tl.int32)
        okn = offs < rem_n
        xn = _tile(_at(x_ptr, b, s0, h, sxb, sxl, sxh), offs, okn, offs_p, P, sxl, EVEN_P)
        dx = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
        if HAS_DIAG:
            dyn = _tile(_at(dy_ptr, b, s0, h, syb, syl, syh), offs, okn, offs_p, P, syl, EVEN_P).to(tl.float32)
            dg = tl.load(_at(diag_ptr, b, s0, h, sgb, sgl, sgh) + offs * sgl, mask=okn, other=0.0)
            dx += dg.to(tl.float32)[:, None] * dyn
            tl.store(ddiag_ptr + (b * L + s0) * H + h + offs * H,
                     tl.sum(dyn * xn.to(tl.float32), 1).to(ddiag_ptr.dtype.element_ty), mask=okn)
        if HAS_SEG:
            seg_n = tl.load(seg_ptr + b * L + s0 + tl.minimum(offs, rem_n - 1))
        for d in tl.static_range(D0, D1):
            slot = d - D0
            vrow = ((slot * BATCH + b) * H + h) * L
            dt_n, a_n, read_n, own_n, tot_n = _tile_logs(d, dtc_ptr, vrow + s0, offs, okn, plane, SHIFT)
            # the other query tiles of the direction's side, the decay between tiles carried along
            Z = tl.zeros([BLOCK_T, BLOCK_P], dtype=tl.float32)
            between = 0.0
            count = _pick(d, NT - 1 - n, n)
            i = count * 0
            while i < count:
                m = _pick(d, n + 1 + i, n - 1 - i)
                t0 = m * BLOCK_T
                rem = (L - t0).to(tl.int32)
                ok = offs < rem
                dt_m, a_m, read_m, own_m, tot_m = _tile_logs(d, dtc_ptr, vrow + t0, offs, ok, plane, SHIFT)
                decay = _pair_decay(read_m, own_n, ok, okn, between)
                if HAS_SEG:
                    seg_m = tl.load(seg_ptr + b * L + t0 + tl.minimum(offs, rem - 1))
                    decay = tl.where(seg_m[:, None] == seg_n[None, :], decay, 0.0)
                cbp = cb_ptr + ((((slot * BATCH + b) * G + g) * NT + m) * NT + n) * BLOCK_T * BLOCK_T
                Mt = tl.load(cbp + offs[:, None] * BLOCK_T + offs[None, :]) * decay
                dym = _tile(_at(dy_ptr, b, t0, h, syb, syl, syh), offs, ok, offs_p, P, syl, EVEN_P)
                Z += _mm(tl.trans(Mt), dym, DOT)
                between += tot_m
                i += 1
            # the key rows' share of da: their pairs with queries beyond the tile
            kx = dt_n * tl.sum(xn.to(tl.float32) * Z, 1)
            tl.store(kq_ptr + plane + vrow + s0 + offs, _dlog_key(d, kx), mask=okn)
            # the diagonal tile pair
            decay = _intra_decay(d, a_n, okn, SHIFT)
            if HAS_SEG:
                decay = tl.where(seg_n[:, None] == seg_n[None, :], decay, 0.0)
            cbp = cb_ptr + ((((slot * BATCH + b) * G + g) * NT + n) * NT + n) * BLOCK_T * BLOCK_T
            dyn = _tile(_at(dy_ptr, b, s0, h, syb, syl, syh), offs, okn, offs_p, P, syl, EVEN_P)
            Z += _mm(tl.trans(tl.load(cbp + offs[:, None] * BLOCK_T + offs[None, :]) * decay), dyn, DOT)
            dx += dt_n[:, None] * Z
            tl.store(kq_ptr + vrow + s0 + offs, tl.sum(xn.to(tl.float32) * Z, 1), mask=okn)
        _store_tile(dx_ptr + ((b * L + s0) * H + h) * P, offs, okn, offs_p, P, H * P, dx, EVEN_P)

    @triton.jit
    def _dx_query_tile(
        x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, seg_ptr, cb_ptr, dtc_ptr, kq_ptr, tot_ptr, b, h, g, m, plane,
        BATCH, L, H, G, P, NT,
        D0: tl.constexpr, D1: tl.constexpr, HAS_SEG: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, EVEN_P: tl.constexpr, DOT: tl.constexpr,
    ):
        """:func:`_dx_kernel`'s query tile m: the rest of the log-decay gradient of its pairs, each term once. Per
        direction: the diagonal tile pair's ``S_ij = (dy_i . x_j) M_ij = dLoss/dL_ij`` (``dy_m x_m^T``, the one
        product the gradient adds), and from the other key tiles n, ``qx_i = dy_i . (sum_{n != m} M_mn x_n)_i``: the
        tile rows' ``da`` on the queries' side (:func:`.triton_kernels._dlog_query`, into ``kq + 2 plane``). Each
        such tile pair's total ``sum(dy_m . M_mn x_n)``, which every row of the tiles strictly between m and n gets,
        goes to ``tot`` (directions, batch, H, NT, NT) at [m, n]."""
        offs = tl.arange(0, BLOCK_T)
        offs_p = tl.arange(0, BLOCK_P)
        t0 = m * BLOCK_T
        rem = (L - t0).to(tl.int32)
        ok = offs < rem
        dym = _tile(_at(dy_ptr, b, t0, h, syb, syl, syh), offs, ok, offs_p, P, syl, EVEN_P)
        xm = _tile(_at(x_ptr, b, t0, h, sxb, sxl, sxh), offs, ok, offs_p, P, sxl, EVEN_P)
        DYX = _mm(dym, tl.trans(xm), DOT)                  # [i, j] = dy_i . x_j, for both directions
        seg_m = offs  # the query tile's segment ids (with HAS_SEG)
        if HAS_SEG:
            seg_m = tl.load(seg_ptr + b * L + t0 + tl.minimum(offs, rem - 1))
            DYX = tl.where(seg_m[:, None] == seg_m[None, :], DYX, 0.0)
        # the diagonal tile pair's share, both directions first (then the (T, T) tiles are done with)
        pairs_f = tl.zeros([BLOCK_T], dtype=tl.float32)
        pairs_b = tl.zeros([BLOCK_T], dtype=tl.float32)
        for d in tl.static_range(D0, D1):
            slot = d - D0
            vbase = ((slot * BATCH + b) * H + h) * L + t0
            cbp = cb_ptr + ((((slot * BATCH + b) * G + g) * NT + m) * NT + m) * BLOCK_T * BLOCK_T
            dt_m, a_m = _decays(dtc_ptr, vbase, offs, ok, plane)
            S = DYX * tl.load(cbp + offs[:, None] * BLOCK_T + offs[None, :]) * _intra_decay(d, a_m, ok, SHIFT)
            S = S * dt_m[None, :]
            if d == 0:
                pairs_f = _dlog_pairs(d, S, SHIFT)
            else:
                pairs_b = _dlog_pairs(d, S, SHIFT)
        # the other key tiles
        for d in tl.static_range(D0, D1):
            slot = d - D0
            vrow = ((slot * BATCH + b) * H + h) * L
            tot = tot_ptr + ((slot * BATCH + b) * H + h) * NT * NT + m * NT
            dt_m, a_m, read_m, own_m, tot_m = _tile_logs(d, dtc_ptr, vrow + t0, offs, ok, plane, SHIFT)
            qx = tl.zeros([BLOCK_T], dtype=tl.float32)
            between = 0.0
            count = _pick(d, m, NT - 1 - m)
            i = count * 0
            while i < count:
                n = _pick(d, m - 1 - i, m + 1 + i)
                s0 = n * BLOCK_T
                rem_n = (L - s0).to(tl.int32)
                okn = offs < rem_n
                dt_n, a_n, read_n, own_n, tot_n = _tile_logs(d, dtc_ptr, vrow + s0, offs, okn, plane, SHIFT)
                decay = _pair_decay(read_m, own_n, ok, okn, between)
                if HAS_SEG:
                    seg_n = tl.load(seg_ptr + b * L + s0 + tl.minimum(offs, rem_n - 1))
                    decay = tl.where(seg_m[:, None] == seg_n[None, :], decay, 0.0)
                cbp = cb_ptr + ((((slot * BATCH + b) * G + g) * NT + m) * NT + n) * BLOCK_T * BLOCK_T
                M = tl.load(cbp + offs[:, None] * BLOCK_T + offs[None, :]) * decay * dt_n[None, :]
                xn = _tile(_at(x_ptr, b, s0, h, sxb, sxl, sxh), offs, okn, offs_p, P, sxl, EVEN_P)
                qn = tl.sum(dym.to(tl.float32) * _mm(M, xn, DOT), 1)
                qx += qn
                tl.store(tot + n, tl.sum(qn, 0))
                between += tot_n
                i += 1
            tl.store(kq_ptr + 2 * plane + vrow + t0 + offs, _dlog_query(d, _pick(d, pairs_f, pairs_b), qx, SHIFT),
                     mask=ok)

    @triton.jit
    def _dx_kernel(
        x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, diag_ptr, sgb, sgl, sgh, seg_ptr, cb_ptr, dtc_ptr, kq_ptr,
        tot_ptr, dx_ptr, ddiag_ptr, BATCH, L, H, G, P, N, NT,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_SEG: tl.constexpr,
        SHIFT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, EVEN_P: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, head, tile t), the backward's first launch: tile t as keys (:func:`_dx_key_tile`: ``dx_t``,
        dt's direct gradient ``kd`` and the key rows' share of the log-decay gradient ``da``), then as queries
        (:func:`_dx_query_tile`: the diagonal pair's and the query rows' shares of ``da``, and the totals of the
        pairs with its other key tiles). Each pair's term is taken once with its own decay (never a total minus a
        prefix); :func:`_step_grads` adds the shares up. ``kq`` (3, directions, batch, H, L) keeps ``kd`` and the
        two shares."""
        pid = tl.program_id(0).to(tl.int64)
        t = pid % NT
        h = (pid // NT) % H
        b = pid // NT // H
        g = h // HG
        plane = (D1 - D0) * BATCH * H * L
        _dx_key_tile(x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, diag_ptr, sgb, sgl, sgh, seg_ptr, cb_ptr, dtc_ptr,
                     kq_ptr, dx_ptr, ddiag_ptr, b, h, g, t, plane, BATCH, L, H, G, P, NT, D0, D1, HAS_DIAG, HAS_SEG,
                     SHIFT, BLOCK_T, BLOCK_P, EVEN_P, DOT)
        _dx_query_tile(x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, seg_ptr, cb_ptr, dtc_ptr, kq_ptr, tot_ptr, b, h,
                       g, t, plane, BATCH, L, H, G, P, NT, D0, D1, HAS_SEG, SHIFT, BLOCK_T, BLOCK_P, EVEN_P, DOT)


# -- host side ----------------------------------------------------------------------------------------

class _Call(_chunked._Call):
    """:class:`.triton_kernels._Call` with the one-chunk geometry."""

    def __init__(self, x: Tensor, dt_f: Tensor | None, A_f: Tensor | None, B_f: Tensor | None, C_f: Tensor | None,
                 dt_b: Tensor | None, A_b: Tensor | None, B_b: Tensor | None, C_b: Tensor | None,
                 diag: Tensor | None, seg: Tensor | None, dt_bias: Tensor | None, dt_lo: float, dt_hi: float,
                 softplus: bool, shift: bool, a_log: bool = False, tile: int | None = None):
        super().__init__(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus,
                         shift, _chunked.ScanGeometry.MAX_CHUNK, a_log)
        g = self.geo
        self.one = OneChunkGeometry(g.batch, g.length, g.heads, g.groups, g.head_dim, g.state, tile)
        self.p_blocks, self.n_blocks = self.one.blocks(self.x.dtype)


def _fwd(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus, shift, a_log=False):
    """Forward: (y, ``C~ B^T`` of the tile pairs (directions, b, g, NT, NT, T, T), prepared step sizes and their log
    decays ``A dt`` (2, directions, b, h, L))."""
    k = _Call(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus, shift, a_log)
    geo = k.one
    bsz, L, H, G, P, N, NT = geo.dims
    T = geo.tile
    dev = x.device
    cb = torch.empty(k.ndirs, bsz, G, NT, NT, T, T, device=dev, dtype=torch.float32)
    dtc = torch.empty(2, k.ndirs, bsz, H, L, device=dev, dtype=torch.float32)
    y = torch.empty(x.shape, device=dev, dtype=x.dtype)
    if x.numel() == 0:
        return y, cb, dtc
    x = k.x
    flags = k.flags
    with on_device(dev):
        _prep_kernel[geo.tile_grid(G)](
            *k.generators()[:8], *_chunked._s3(k.dt[0]), *_chunked._s3(k.B[0]), k.ptr(k.bias), cb, dtc,
            *geo.dims[:6], NT, *k.lo_hi, HG=flags["HG"], D0=flags["D0"], D1=flags["D1"], **k.prep,
            SHIFT=flags["SHIFT"], **k.n_blocks, **LAUNCH["prep"])
        _out_kernel[geo.tile_grid(H)](
            x, *_chunked._s3(x), k.ptr(diag), *_chunked._s3(diag), k.ptr(seg), cb, dtc, y, *geo.dims, **flags,
            HAS_DIAG=diag is not None, **k.p_blocks, **LAUNCH["out"])
    return y, cb, dtc


def _bwd(dy, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus, shift, cb,
         dtc, a_log=False):
    """Backward: [dx, ddt_f, dB_f, dC_f, ddt_b, dB_b, dC_b, ddiag, partials] in the inputs' dtypes (an empty tensor
    for an absent input); ``partials`` (b, 3, h) float32: per-sequence dA forward, dA backward, d dt_bias."""
    k = _Call(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus, shift, a_log)
    geo = k.one
    bsz, L, H, G, P, N, NT = geo.dims
    dev = x.device
    dx, ddt_f, dB_f, dC_f, ddt_b, dB_b, dC_b, ddiag = _chunked._grad_buffers(x, dt_f, B_f, C_f, dt_b, B_b, C_b, diag)
    part = torch.empty(bsz * NT, 3, H, device=dev, dtype=torch.float32)
    if x.numel() == 0:
        return [dx, ddt_f, dB_f, dC_f, ddt_b, dB_b, dC_b, ddiag, part]
    x, dy = k.x, _chunked._unit_last(dy)
    HB = geo.head_blocks()
    dcb = torch.empty((HB, *cb.shape), device=dev, dtype=torch.float32)
    kq = torch.empty(3, k.ndirs, bsz, H, L, device=dev, dtype=torch.float32)
    tot = torch.empty(k.ndirs, bsz, H, NT, NT, device=dev, dtype=torch.float32)
    flags = k.flags
    grids = geo.grids()
    s3 = _chunked._s3
    with on_device(dev):
        _dx_kernel[grids["dx"]](
            x, *s3(x), dy, *s3(dy), k.ptr(diag), *s3(diag), k.ptr(seg), cb, dtc, kq, tot, dx,
            k.ptr(ddiag if diag is not None else None), *geo.dims, **flags, HAS_DIAG=diag is not None, **k.p_blocks,
            **LAUNCH["dx"])
        _dcb_kernel[grids["dcb"]](
            x, *s3(x), dy, *s3(dy), k.dt[0], k.A[0], k.dt[1], k.A[1], *s3(k.dt[0]), k.ptr(k.bias), k.ptr(seg), dtc,
            kq, tot, dcb, *k.outputs(ddt_f, ddt_b), part, *geo.dims, *k.lo_hi, HB=HB, **flags, **k.prep,
            SHARED_A=k.shared_A, BLOCK_NT=max(2, pow2(NT)), **k.p_blocks, **LAUNCH["dcb"])
        _dbc_kernel[grids["dbc"]](
            k.B[0], k.C[0], k.B[1], k.C[1], *s3(k.B[0]), dcb, *k.outputs(dB_f, dB_b), *k.outputs(dC_f, dC_b),
            bsz, L, G, N, NT, HB=HB, D0=flags["D0"], D1=flags["D1"], SHIFT=flags["SHIFT"], **k.n_blocks,
            **LAUNCH["dbc"])
    return [dx, ddt_f, dB_f, dC_f, ddt_b, dB_b, dC_b, ddiag, part]


# -- custom ops ----------------------------------------------------------------------------------------

@torch.library.custom_op("mixer_plugins::quasiseparable_triton_one_chunk", mutates_args=())
def _op(
    x: Tensor, dt_f: Optional[Tensor], A_f: Optional[Tensor], B_f: Optional[Tensor], C_f: Optional[Tensor],
    dt_b: Optional[Tensor], A_b: Optional[Tensor], B_b: Optional[Tensor], C_b: Optional[Tensor],
    diag: Optional[Tensor], seg: Optional[Tensor], dt_bias: Optional[Tensor], dt_lo: float, dt_hi: float,
    softplus: bool, shift: bool, a_log: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The one-chunk scan's forward (:func:`_fwd`); the two directions' generators share dtypes."""
    return tuple(_fwd(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus,
                      shift, a_log))


@_op.register_fake
def _op_fake(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus, shift,
             a_log=False):
    bsz, L, H, P = x.shape
    ref_B = B_f if B_f is not None else B_b
    geo = OneChunkGeometry(bsz, L, H, ref_B.shape[2], P, ref_B.shape[3])
    nd = int(dt_f is not None) + int(dt_b is not None)
    T, NT = geo.tile, geo.ntiles
    f32 = torch.float32
    return (x.new_empty(x.shape), x.new_empty(nd, bsz, geo.groups, NT, NT, T, T, dtype=f32),
            x.new_empty(2, nd, bsz, H, L, dtype=f32))


@torch.library.custom_op("mixer_plugins::quasiseparable_triton_one_chunk_backward", mutates_args=())
def _bwd_op(
    dy: Tensor, x: Tensor, dt_f: Optional[Tensor], A_f: Optional[Tensor], B_f: Optional[Tensor],
    C_f: Optional[Tensor], dt_b: Optional[Tensor], A_b: Optional[Tensor], B_b: Optional[Tensor],
    C_b: Optional[Tensor], diag: Optional[Tensor], seg: Optional[Tensor], dt_bias: Optional[Tensor], dt_lo: float,
    dt_hi: float, softplus: bool, shift: bool, cb: Tensor, dtc: Tensor, a_log: bool = False,
) -> list[Tensor]:
    """The one-chunk scan's backward (:func:`_bwd`); the partials are summed by the caller."""
    return _bwd(dy, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus,
                shift, cb, dtc, a_log)


@_bwd_op.register_fake
def _bwd_op_fake(dy, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus,
                 shift, cb, dtc, a_log=False):
    ref_B = B_f if B_f is not None else B_b
    geo = OneChunkGeometry(x.shape[0], x.shape[1], x.shape[2], ref_B.shape[2], x.shape[3], ref_B.shape[3])
    return [*_chunked._grad_buffers(x, dt_f, B_f, C_f, dt_b, B_b, C_b, diag),
            x.new_empty(x.shape[0] * geo.ntiles, 3, x.shape[2], dtype=torch.float32)]


_INPUTS = ("x", "dt_f", "A_f", "B_f", "C_f", "dt_b", "A_b", "B_b", "C_b", "diag", "seg", "dt_bias")


def _setup_context(ctx, inputs, output):
    _chunked._save(ctx, inputs[:12], output[1:], inputs[12:16], inputs[16])


def _autograd_backward(ctx, dy, dcb, ddtc):
    if dy is None:
        return (None,) * 17
    x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, cb, dtc = ctx.saved_tensors
    grads = _bwd_op(dy, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, *ctx.options, cb, dtc,
                    ctx.a_log)
    return _chunked._input_grads(ctx, _INPUTS, grads, _chunked._GRADS)


_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def scan_one_chunk_flops(batch: int, length: int, heads: int, head_dim: int, state: int, directions: int,
                         backward: bool = False, groups: int = 1) -> int:
    """FLOPs (2 per multiply-add) of the one-chunk kernels' matmuls over the tile pairs they visit (each direction
    its side of the diagonal, the diagonal tiles both); elementwise work is not counted.

    Forward: ``C~ B^T`` once per group (2 T^2 n g per pair) and ``M x`` per head (2 T^2 h p per pair). Backward:
    ``dy x^T`` (2 T^2 h p) and ``d(C~ B^T)`` times B and C (2 x 2 T^2 n g) per pair, and per head ``M~^T dy`` and
    ``M x`` again (2 x 2 T^2 h p).
    """
    geo = OneChunkGeometry(batch, length, heads, groups, head_dim, state)
    t, nt = geo.tile, geo.ntiles
    pairs = directions * nt * (nt + 1) // 2
    if not backward:
        return batch * pairs * (2 * t * t * groups * state + 2 * t * t * heads * head_dim)
    return batch * pairs * (6 * t * t * heads * head_dim + 4 * t * t * groups * state)


@register_flop_formula(torch.ops.mixer_plugins.quasiseparable_triton_one_chunk)
def _op_flops(*shapes, out_shape=None, **kwargs) -> int:
    return scan_one_chunk_flops(**_chunked._flop_shapes(*shapes))


@register_flop_formula(torch.ops.mixer_plugins.quasiseparable_triton_one_chunk_backward)
def _bwd_op_flops(dy_shape, *shapes, out_shape=None, **kwargs) -> int:
    return scan_one_chunk_flops(**_chunked._flop_shapes(*shapes), backward=True)


def scan_one_chunk(
    x: Tensor,
    dt_f: Tensor | None, A_f: Tensor | None, B_f: Tensor | None, C_f: Tensor | None,
    dt_b: Tensor | None = None, A_b: Tensor | None = None, B_b: Tensor | None = None, C_b: Tensor | None = None,
    diag: Tensor | None = None, seq_idx: Tensor | None = None, *, dt_bias: Tensor | None = None,
    dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf), shift: bool = False,
    a_log: bool = False,
) -> Tensor:
    """The one-chunk scan (no states), differentiable; the arguments of :func:`.triton_kernels.scan_triton` without
    the states (raw step sizes prepared in the kernels, ``seq_idx`` normalised segment ids, ``a_log``: the ``A``
    arguments hold ``A_log``)."""
    dt_b, A_b, B_b, C_b = _chunked._backward_generators(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b)
    lo, hi = dt_limit
    y, _, _ = _op(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, _chunked._seg_arg(seq_idx), dt_bias, float(lo),
                  float(hi), bool(dt_softplus), bool(shift), bool(a_log))
    return y
