"""The fused chunked scan in Triton, forward and backward (the kernels of the ``triton`` backend, :mod:`.triton`).

Computes exactly what ``mixer_plugins.kernels.quasiseparable`` computes (see :mod:`.reference` for the
matrix entries), for both directions in **one** chunked pass: per chunk of Q tokens, one Q x Q block holds
the lower (forward direction), upper (backward direction) and diagonal parts and is applied with one
matmul; between chunks two light state passes run, the forward state left to right and the backward state
right to left. No flipped copy of the input and no doubled batch.

Per head, with ``a = A * dt`` and chunk-local cumsums ``p`` (inclusive) and ``e`` (exclusive, selected from ``p``):

* forward (lower) entries inside a chunk: ``C~_i.B_j exp(q_i - p_j) dt_j`` (``j < i`` shifted, ``j <= i``
  not; ``q = e`` shifted, ``p`` not; ``C~_i = C_{i-1}`` shifted);
* backward (upper) entries: ``C~_i.B_j exp(e_j - q_i) dt_j`` (``j > i`` / ``j >= i``; ``q = p`` shifted,
  ``e`` not; ``C~_i = C_{i+1}`` shifted);
* forward state entering chunk c: ``H_{c+1} = exp(p_last) H_c + sum_j exp(p_last - p_j) dt_j x_j B_j^T``,
  read as ``exp(q_i) H_c C~_i``;
* backward state entering chunk c from the right: ``G_{c-1} = exp(p_last) G_c + sum_j exp(e_j) dt_j x_j B_j^T``,
  read as ``exp(p_last - q_i) G_c C~_i``.

Kernels (each program = one (chunk, batch*head)):

* ``_chunk_states_kernel``: each chunk's own states of both directions and their log carries;
* ``_state_pass_kernel``: the sequential inter-chunk recurrence ``S_next = exp(lg_c) S_c + src_c`` for both
  directions in one launch (one direction left to right, the other right to left); reused in the backward
  pass for the state gradients, which obey the same recurrence run the other way;
* ``_chunk_out_kernel``: y = (lower + upper + diag block) @ x + both state read-outs;
* ``_chunk_dread_kernel``: the gradient of the read-outs with respect to the entering states;
* ``_chunk_bwd_kernel``: dx, dB, dC (per head, group-summed in PyTorch), ddt (including the decay path
  ``A * d(a)``), per-chunk partials of dA, and ddiag; launched once per direction (dx parts summed).

``seq_idx`` (packed segments): a new segment starts wherever the id changes; pairs across segments are
masked inside a chunk and the states are gated between chunks, so neither direction nor the shift crosses a
segment boundary. Step-size preparation (``dt_bias``, softplus, ``dt_limit``) runs in PyTorch before the
kernels, with autograd through it. Inputs may be float32, bfloat16 or float16; everything is accumulated in
float32 (matmuls in IEEE fp32), and the result has ``x``'s dtype.

Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._triton._common import available, dot_precision, tl, triton
from .._triton._common import mm as _mm

__all__ = ["available", "scan_triton", "scan_triton_flops"]

#: Triton launch options (``num_warps``, ``num_stages``) of each kernel; empty = Triton's defaults.
#: ``benchmarks/gpu/tune.py`` times alternatives on a GPU.
LAUNCH: dict[str, dict[str, int]] = {"states": {}, "pass": {}, "out": {}, "dread": {}, "bwd": {}}


def _block(n: int) -> int:
    """Block size for a dimension: a power of two, at least 16 (tl.dot's minimum on GPUs)."""
    return max(16, triton.next_power_of_2(int(n)))


if triton is not None:

    @triton.jit
    def _prefix(a, ok):
        """A chunk's inclusive sums ``p = cumsum(a)``, exclusive sums ``e`` and total ``plast`` (``p`` at the last valid
        row). ``e`` and ``plast`` are selected from ``p``, so ``e_i`` is ``p_{i-1}`` bit for bit (``p - a`` would carry
        one more rounding, of the size of ``p``'s last bit): the decay between neighbours is exactly 1 however
        large ``|p|`` grows within the chunk."""
        p = tl.cumsum(a, 0)
        idx = tl.cumsum(tl.full(a.shape, 1, tl.int32), 0) - 1
        last = tl.sum(ok.to(tl.int32), 0) - 1
        e = tl.sum(tl.where(idx[:, None] - 1 == idx[None, :], p[None, :], 0.0), 1)
        plast = tl.sum(tl.where(idx == last, p, 0.0), 0)
        return p, e, plast

    @triton.jit
    def _chunk_states_kernel(
        x_ptr, dtf_ptr, Af_ptr, Bf_ptr, dtb_ptr, Ab_ptr, Bb_ptr, seg_ptr, st_ptr, lg_ptr,
        BATCH, L, H, G, P, N, NC, Q,
        HAS_F: tl.constexpr, HAS_B: tl.constexpr, HAS_SEG: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    ):
        c = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // H
        h = pid % H
        g = h // (H // G)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        t = c * Q + offs_q
        ok = (offs_q < Q) & (t < L)
        x = tl.load(x_ptr + ((b * L + t[:, None]) * H + h) * P + offs_p[None, :],  # (Q, P)
                    mask=ok[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
        st_off = offs_p[:, None] * N + offs_n[None, :]
        st_mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
        if HAS_SEG:
            seg = tl.load(seg_ptr + b * L + tl.minimum(t, L - 1))
            seg_first = tl.load(seg_ptr + b * L + c * Q)
            seg_last = tl.load(seg_ptr + b * L + tl.minimum(c * Q + Q - 1, L - 1))
            seg_before = tl.load(seg_ptr + b * L + tl.maximum(c * Q - 1, 0))
            seg_after = tl.load(seg_ptr + b * L + tl.minimum(c * Q + Q, L - 1))
        if HAS_F:
            dt = tl.load(dtf_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
            a = dt * tl.load(Af_ptr + h).to(tl.float32)
            p, e, plast = _prefix(a, ok)
            w = tl.exp(plast - p) * dt
            lg = plast
            if HAS_SEG:
                w = tl.where(seg == seg_last, w, 0.0)
                lg = tl.where(seg_last == seg_before, plast, float("-inf"))
            Bt = tl.load(Bf_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                         mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
            S = _mm(tl.trans(x * w[:, None]), Bt, DOT)     # (P, N)
            base = (b * NC + c) * H + h
            tl.store(st_ptr + base * P * N + st_off, S, mask=st_mask)
            tl.store(lg_ptr + base, lg)
        if HAS_B:
            dt = tl.load(dtb_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
            a = dt * tl.load(Ab_ptr + h).to(tl.float32)
            p, e, plast = _prefix(a, ok)
            w = tl.exp(e) * dt
            lg = plast
            if HAS_SEG:
                w = tl.where(seg == seg_first, w, 0.0)
                lg = tl.where(seg_first == seg_after, plast, float("-inf"))
            Bt = tl.load(Bb_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                         mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
            S = _mm(tl.trans(x * w[:, None]), Bt, DOT)
            base = ((BATCH + b) * NC + c) * H + h
            tl.store(st_ptr + base * P * N + st_off, S, mask=st_mask)
            tl.store(lg_ptr + base, lg)

    @triton.jit
    def _state_pass_kernel(
        src_ptr, lg_ptr, out_ptr, init_ptr, final_ptr, BATCH, H, NC, PN,
        DIR0: tl.constexpr, REV_FIRST: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """``out_c`` = the state entering chunk c of ``S <- exp(lg_c) S + src_c``; direction d runs right to
        left when ``(d + REV_FIRST)`` is odd. Buffers are (2, batch, NC, H, PN); init/final (2, batch, H, PN)."""
        pid = tl.program_id(0)
        d = DIR0 + tl.program_id(1)
        blk = tl.program_id(2)
        b = pid // H
        h = pid % H
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        m = offs < PN
        rev = (d + REV_FIRST) % 2
        io = ((d * BATCH + b) * H + h) * PN + offs
        if HAS_INIT:
            state = tl.load(init_ptr + io, mask=m, other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BLOCK], dtype=tl.float32)
        # a while loop, not range(NC): the 3.5 interpreter cannot turn a runtime scalar into a Python int
        # under NumPy >= 2.3 (it converts a shape-(1,) array with int()); compiled kernels are equivalent
        k = 0
        while k < NC:
            c = k + rev * (NC - 1 - 2 * k)
            base = ((d * BATCH + b) * NC + c) * H + h
            tl.store(out_ptr + base * PN + offs, state, mask=m)
            gamma = tl.exp(tl.load(lg_ptr + base))
            state = gamma * state + tl.load(src_ptr + base * PN + offs, mask=m, other=0.0)
            k += 1
        tl.store(final_ptr + io, state, mask=m)

    @triton.jit
    def _chunk_out_kernel(
        x_ptr, dtf_ptr, Af_ptr, Bf_ptr, Cf_ptr, dtb_ptr, Ab_ptr, Bb_ptr, Cb_ptr, diag_ptr, seg_ptr, hs_ptr,
        y_ptr, BATCH, L, H, G, P, N, NC, Q,
        HAS_F: tl.constexpr, HAS_B: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_SEG: tl.constexpr,
        SHIFT: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    ):
        c = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // H
        h = pid % H
        g = h // (H // G)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        t = c * Q + offs_q
        ok = (offs_q < Q) & (t < L)
        ii = offs_q[:, None]
        jj = offs_q[None, :]
        valid = ok[:, None] & ok[None, :]
        if HAS_SEG:
            seg = tl.load(seg_ptr + b * L + tl.minimum(t, L - 1))
            valid = valid & (seg[:, None] == seg[None, :])
            seg_before = tl.load(seg_ptr + b * L + tl.maximum(c * Q - 1, 0))
            seg_after = tl.load(seg_ptr + b * L + tl.minimum(c * Q + Q, L - 1))
        x = tl.load(x_ptr + ((b * L + t[:, None]) * H + h) * P + offs_p[None, :],
                    mask=ok[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
        st_off = offs_p[:, None] * N + offs_n[None, :]
        st_mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
        acc = tl.zeros([BLOCK_Q, BLOCK_P], dtype=tl.float32)
        M = tl.zeros([BLOCK_Q, BLOCK_Q], dtype=tl.float32)
        if HAS_F:
            dt = tl.load(dtf_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
            a = dt * tl.load(Af_ptr + h).to(tl.float32)
            p, e, plast = _prefix(a, ok)
            if SHIFT:
                q = e
                Ct = tl.load(Cf_ptr + ((b * L + (t - 1)[:, None]) * G + g) * N + offs_n[None, :],
                             mask=(ok & (t >= 1))[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
                allowed = valid & (jj < ii)
            else:
                q = p
                Ct = tl.load(Cf_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                             mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
                allowed = valid & (jj <= ii)
            Bt = tl.load(Bf_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                         mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
            CB = _mm(Ct, tl.trans(Bt), DOT)
            decay = tl.exp(tl.where(allowed, q[:, None] - p[None, :], float("-inf")))
            M += CB * decay * dt[None, :]
            Hc = tl.load(hs_ptr + ((b * NC + c) * H + h) * P * N + st_off, mask=st_mask, other=0.0)
            wq = tl.exp(q)
            if HAS_SEG:
                wq = tl.where(seg == seg_before, wq, 0.0)
            acc += _mm(Ct, tl.trans(Hc), DOT) * wq[:, None]
        if HAS_B:
            dt = tl.load(dtb_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
            a = dt * tl.load(Ab_ptr + h).to(tl.float32)
            p, e, plast = _prefix(a, ok)
            if SHIFT:
                q = p
                Ct = tl.load(Cb_ptr + ((b * L + (t + 1)[:, None]) * G + g) * N + offs_n[None, :],
                             mask=(ok & (t + 1 < L))[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
                allowed = valid & (jj > ii)
            else:
                q = e
                Ct = tl.load(Cb_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                             mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
                allowed = valid & (jj >= ii)
            Bt = tl.load(Bb_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                         mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
            CB = _mm(Ct, tl.trans(Bt), DOT)
            decay = tl.exp(tl.where(allowed, e[None, :] - q[:, None], float("-inf")))
            M += CB * decay * dt[None, :]
            Gc = tl.load(hs_ptr + (((BATCH + b) * NC + c) * H + h) * P * N + st_off, mask=st_mask, other=0.0)
            wq = tl.exp(plast - q)
            if HAS_SEG:
                wq = tl.where(seg == seg_after, wq, 0.0)
            acc += _mm(Ct, tl.trans(Gc), DOT) * wq[:, None]
        if HAS_DIAG:
            dg = tl.load(diag_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
            M += tl.where(ii == jj, dg[:, None], 0.0)
        acc += _mm(M, x, DOT)
        y_ptrs = y_ptr + ((b * L + t[:, None]) * H + h) * P + offs_p[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & (offs_p < P)[None, :])

    @triton.jit
    def _chunk_dread_kernel(
        dy_ptr, dtf_ptr, Af_ptr, Cf_ptr, dtb_ptr, Ab_ptr, Cb_ptr, seg_ptr, dst_ptr,
        BATCH, L, H, G, P, N, NC, Q,
        HAS_F: tl.constexpr, HAS_B: tl.constexpr, HAS_SEG: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """Gradient of the chunk's read-outs w.r.t. the state entering it: ``sum_i w_i dy_i C~_i^T``."""
        c = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // H
        h = pid % H
        g = h // (H // G)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        t = c * Q + offs_q
        ok = (offs_q < Q) & (t < L)
        if HAS_SEG:
            seg = tl.load(seg_ptr + b * L + tl.minimum(t, L - 1))
            seg_before = tl.load(seg_ptr + b * L + tl.maximum(c * Q - 1, 0))
            seg_after = tl.load(seg_ptr + b * L + tl.minimum(c * Q + Q, L - 1))
        dy = tl.load(dy_ptr + ((b * L + t[:, None]) * H + h) * P + offs_p[None, :],
                     mask=ok[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
        st_off = offs_p[:, None] * N + offs_n[None, :]
        st_mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
        if HAS_F:
            dt = tl.load(dtf_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
            a = dt * tl.load(Af_ptr + h).to(tl.float32)
            p, e, plast = _prefix(a, ok)
            if SHIFT:
                q = e
                Ct = tl.load(Cf_ptr + ((b * L + (t - 1)[:, None]) * G + g) * N + offs_n[None, :],
                             mask=(ok & (t >= 1))[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
            else:
                q = p
                Ct = tl.load(Cf_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                             mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
            wq = tl.exp(q)
            if HAS_SEG:
                wq = tl.where(seg == seg_before, wq, 0.0)
            dH = _mm(tl.trans(dy * wq[:, None]), Ct, DOT)
            tl.store(dst_ptr + ((b * NC + c) * H + h) * P * N + st_off, dH, mask=st_mask)
        if HAS_B:
            dt = tl.load(dtb_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
            a = dt * tl.load(Ab_ptr + h).to(tl.float32)
            p, e, plast = _prefix(a, ok)
            if SHIFT:
                q = p
                Ct = tl.load(Cb_ptr + ((b * L + (t + 1)[:, None]) * G + g) * N + offs_n[None, :],
                             mask=(ok & (t + 1 < L))[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
            else:
                q = e
                Ct = tl.load(Cb_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                             mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
            wq = tl.exp(plast - q)
            if HAS_SEG:
                wq = tl.where(seg == seg_after, wq, 0.0)
            dG = _mm(tl.trans(dy * wq[:, None]), Ct, DOT)
            tl.store(dst_ptr + (((BATCH + b) * NC + c) * H + h) * P * N + st_off, dG, mask=st_mask)

    @triton.jit
    def _direction_bwd(
        x, dy, DYX, dx, b, c, h, g, t, ok, valid, ii, jj, seg, seg_read, seg_own,
        dt_ptr, A_ptr, B_ptr, C_ptr, hs_ptr, ds_ptr, lg_ptr, dB_ptr, dC_ptr, ddt_ptr, dA_ptr,
        BATCH, L, H, G, P, N, NC, offs_n, st_off, st_mask, DIR: tl.constexpr,
        HAS_SEG: tl.constexpr, SHIFT: tl.constexpr, DOT: tl.constexpr,
    ):
        """All gradients of one direction inside one chunk; returns dx with this direction's part added.

        DIR 0 = forward (lower), 1 = backward (upper). ``seg_read``: the segment the entering state belongs
        to; ``seg_own``: the segment this chunk's own state collects.
        """
        dt = tl.load(dt_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
        A = tl.load(A_ptr + h).to(tl.float32)
        a = dt * A
        p, e, plast = _prefix(a, ok)
        Bt = tl.load(B_ptr + ((b * L + t[:, None]) * G + g) * N + offs_n[None, :],
                     mask=ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
        if DIR == 0:
            if SHIFT:
                q = e
                tc = t - 1
                c_ok = ok & (t >= 1)
                allowed = valid & (jj < ii)
            else:
                q = p
                tc = t
                c_ok = ok
                allowed = valid & (jj <= ii)
            logw = q[:, None] - p[None, :]
            wq = tl.exp(q)
            wsraw = tl.exp(plast - p)
        else:
            if SHIFT:
                q = p
                tc = t + 1
                c_ok = ok & (t + 1 < L)
                allowed = valid & (jj > ii)
            else:
                q = e
                tc = t
                c_ok = ok
                allowed = valid & (jj >= ii)
            logw = e[None, :] - q[:, None]
            wq = tl.exp(plast - q)
            wsraw = tl.exp(e)
        wsraw = tl.where(ok, wsraw, 0.0)
        if HAS_SEG:
            wq = tl.where(seg == seg_read, wq, 0.0)
            wsraw = tl.where(seg == seg_own, wsraw, 0.0)
        Ct = tl.load(C_ptr + ((b * L + tc[:, None]) * G + g) * N + offs_n[None, :],
                     mask=c_ok[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
        sbase = ((DIR * BATCH + b) * NC + c) * H + h
        Hc = tl.load(hs_ptr + sbase * P * N + st_off, mask=st_mask, other=0.0)   # state read by this chunk
        dS = tl.load(ds_ptr + sbase * P * N + st_off, mask=st_mask, other=0.0)   # grad of this chunk's own state
        lg = tl.load(lg_ptr + sbase)

        # intra-chunk block
        CB = _mm(Ct, tl.trans(Bt), DOT)
        decay = tl.exp(tl.where(allowed, logw, float("-inf")))
        ldt = decay * dt[None, :]
        dx += _mm(tl.trans(CB * ldt), dy, DOT)
        dCB = DYX * ldt
        dCt = _mm(dCB, Bt, DOT)
        dBt = _mm(tl.trans(dCB), Ct, DOT)
        K = DYX * CB * decay
        ddt = tl.sum(K, 0)
        R = K * dt[None, :]
        d_query = tl.sum(R, 1)       # d/d(log weight), summed over keys, per query i
        d_key = tl.sum(R, 0)         # per key j
        # read-out of the entering state
        HC = _mm(Ct, tl.trans(Hc), DOT)                      # (Q, P)
        Rr = wq * tl.sum(dy * HC, 1)
        dCt += _mm(dy * wq[:, None], Hc, DOT)
        # this chunk's own state
        xdS = _mm(x, dS, DOT)                                # (Q, N)
        val = tl.sum(xdS * Bt, 1)
        ws = wsraw * dt
        Rs = ws * val
        ddt += wsraw * val
        dBt += ws[:, None] * xdS
        dx += ws[:, None] * _mm(Bt, tl.trans(dS), DOT)
        dplast = tl.exp(lg) * tl.sum(tl.sum(dS * Hc, 1), 0)
        if DIR == 0:
            # log weights: q_i - p_j (intra), q_i (read-out), p_last - p_j (own state)
            dq = d_query + Rr
            dp = -d_key - Rs
            de = tl.zeros_like(dp)
            dplast += tl.sum(Rs, 0)
        else:
            # log weights: e_j - q_i (intra), p_last - q_i (read-out), e_j (own state)
            dq = -d_query - Rr
            de = d_key + Rs
            dp = tl.zeros_like(de)
            dplast += tl.sum(Rr, 0)
        if SHIFT == (DIR == 0):
            de += dq
        else:
            dp += dq
        # p_i = sum_{k<=i} a_k, e_i = sum_{k<i} a_k, p_last = sum_k a_k
        da = (tl.sum(dp, 0) - tl.cumsum(dp, 0) + dp) + (tl.sum(de, 0) - tl.cumsum(de, 0)) + dplast
        da = tl.where(ok, da, 0.0)
        tl.store(ddt_ptr + (b * L + t) * H + h, ddt + A * da, mask=ok)
        tl.store(dA_ptr + (b * NC + c) * H + h, tl.sum(dt * da, 0))
        rows = ((b * L + t[:, None]) * H + h) * N + offs_n[None, :]
        tl.store(dB_ptr + rows, dBt, mask=ok[:, None] & (offs_n < N)[None, :])
        crows = ((b * L + tc[:, None]) * H + h) * N + offs_n[None, :]
        tl.store(dC_ptr + crows, dCt, mask=c_ok[:, None] & (offs_n < N)[None, :])
        return dx

    @triton.jit
    def _chunk_bwd_kernel(
        x_ptr, dy_ptr, dtf_ptr, Af_ptr, Bf_ptr, Cf_ptr, dtb_ptr, Ab_ptr, Bb_ptr, Cb_ptr, diag_ptr, seg_ptr,
        hs_ptr, ds_ptr, lg_ptr,
        dx_ptr, dBf_ptr, dCf_ptr, ddtf_ptr, dAf_ptr, dBb_ptr, dCb_ptr, ddtb_ptr, dAb_ptr, ddiag_ptr,
        BATCH, L, H, G, P, N, NC, Q,
        HAS_F: tl.constexpr, HAS_B: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_SEG: tl.constexpr,
        SHIFT: tl.constexpr, ACC_DX: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    ):
        c = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // H
        h = pid % H
        g = h // (H // G)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        t = c * Q + offs_q
        ok = (offs_q < Q) & (t < L)
        ii = offs_q[:, None]
        jj = offs_q[None, :]
        valid = ok[:, None] & ok[None, :]
        seg = offs_q
        seg_before = 0
        seg_after = 0
        seg_first = 0
        seg_last = 0
        if HAS_SEG:
            seg = tl.load(seg_ptr + b * L + tl.minimum(t, L - 1))
            valid = valid & (seg[:, None] == seg[None, :])
            seg_before = tl.load(seg_ptr + b * L + tl.maximum(c * Q - 1, 0))
            seg_after = tl.load(seg_ptr + b * L + tl.minimum(c * Q + Q, L - 1))
            seg_first = tl.load(seg_ptr + b * L + c * Q)
            seg_last = tl.load(seg_ptr + b * L + tl.minimum(c * Q + Q - 1, L - 1))
        x = tl.load(x_ptr + ((b * L + t[:, None]) * H + h) * P + offs_p[None, :],
                    mask=ok[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + ((b * L + t[:, None]) * H + h) * P + offs_p[None, :],
                     mask=ok[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
        st_off = offs_p[:, None] * N + offs_n[None, :]
        st_mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
        DYX = _mm(dy, tl.trans(x), DOT)                       # [i, j] = dy_i . x_j
        dx = tl.zeros([BLOCK_Q, BLOCK_P], dtype=tl.float32)
        if HAS_DIAG:
            dg = tl.load(diag_ptr + (b * L + t) * H + h, mask=ok, other=0.0).to(tl.float32)
            dx += dg[:, None] * dy
            tl.store(ddiag_ptr + (b * L + t) * H + h, tl.sum(dy * x, 1), mask=ok)
        if HAS_F:
            dx = _direction_bwd(x, dy, DYX, dx, b, c, h, g, t, ok, valid, ii, jj, seg, seg_before, seg_last,
                                dtf_ptr, Af_ptr, Bf_ptr, Cf_ptr, hs_ptr, ds_ptr, lg_ptr, dBf_ptr, dCf_ptr,
                                ddtf_ptr, dAf_ptr, BATCH, L, H, G, P, N, NC, offs_n, st_off, st_mask,
                                0, HAS_SEG, SHIFT, DOT)
        if HAS_B:
            dx = _direction_bwd(x, dy, DYX, dx, b, c, h, g, t, ok, valid, ii, jj, seg, seg_after, seg_first,
                                dtb_ptr, Ab_ptr, Bb_ptr, Cb_ptr, hs_ptr, ds_ptr, lg_ptr, dBb_ptr, dCb_ptr,
                                ddtb_ptr, dAb_ptr, BATCH, L, H, G, P, N, NC, offs_n, st_off, st_mask,
                                1, HAS_SEG, SHIFT, DOT)
        dx_ptrs = dx_ptr + ((b * L + t[:, None]) * H + h) * P + offs_p[None, :]
        dx_mask = ok[:, None] & (offs_p < P)[None, :]
        if ACC_DX:  # the other direction's launch (earlier on the same stream) wrote its part
            dx += tl.load(dx_ptrs, mask=dx_mask, other=0.0)
        tl.store(dx_ptrs, dx, mask=dx_mask)


# -- host side ----------------------------------------------------------------------------------------

def _segments(seq_idx: Tensor | None) -> Tensor | None:
    """Segment numbers 0, 1, ...: a new segment starts wherever the id changes (int32, (b, l))."""
    if seq_idx is None:
        return None
    change = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    return torch.cat([torch.zeros_like(change[:, :1]), change.cumsum(1, dtype=torch.int32)], dim=1).contiguous()


def _c(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


class _Geometry:
    def __init__(self, x: Tensor, B: Tensor, chunk_size: int):
        self.batch, self.length, self.heads, self.hdim = x.shape
        self.groups, self.nstate = B.shape[2], B.shape[3]
        self.Q = min(int(chunk_size), self.length)
        self.nchunks = -(-self.length // self.Q)
        self.blocks = dict(BLOCK_Q=_block(self.Q), BLOCK_P=_block(self.hdim), BLOCK_N=_block(self.nstate),
                           DOT=dot_precision(x.dtype))
        self.grid = (self.nchunks, self.batch * self.heads)
        pn = self.hdim * self.nstate
        self.pn_block = min(1024, triton.next_power_of_2(pn))
        self.dims = (self.batch, self.length, self.heads, self.groups, self.hdim, self.nstate, self.nchunks, self.Q)

    def pass_grid(self, ndirs: int) -> tuple[int, int, int]:
        return (self.batch * self.heads, ndirs, triton.cdiv(self.hdim * self.nstate, self.pn_block))


def _dirs(has_f: bool, has_b: bool) -> tuple[int, int]:
    """(first direction index, number of directions) for the state-pass grid."""
    return (0 if has_f else 1), int(has_f) + int(has_b)


def _scan_fwd(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, init, shift: bool, chunk_size: int):
    """Forward pass. Returns y, the entering states (2, b, NC, h, p, n), the log carries and the final state."""
    has_f, has_b = dt_f is not None, dt_b is not None
    ref_B = B_f if has_f else B_b
    geo = _Geometry(x, ref_B, chunk_size)
    bsz, L, H, G, P, N, NC, Q = geo.dims
    dev = x.device
    # every entry of the present directions is written by the kernel (an absent direction's half is never read)
    st = torch.empty(2, bsz, NC, H, P, N, device=dev, dtype=torch.float32)
    lg = torch.zeros(2, bsz, NC, H, device=dev, dtype=torch.float32)
    dummy = x
    args_f = (dt_f, A_f, B_f) if has_f else (dummy, dummy, dummy)
    args_b = (dt_b, A_b, B_b) if has_b else (dummy, dummy, dummy)
    seg_arg = seg if seg is not None else dummy
    _chunk_states_kernel[geo.grid](
        x, *args_f, *args_b, seg_arg, st, lg, *geo.dims,
        HAS_F=has_f, HAS_B=has_b, HAS_SEG=seg is not None, **geo.blocks, **LAUNCH["states"])
    hs = torch.empty_like(st)
    init_buf = torch.zeros(2, bsz, H, P, N, device=dev, dtype=torch.float32)
    if init is not None:
        init_buf[0] = init.to(torch.float32)
    final = torch.zeros_like(init_buf)
    d0, nd = _dirs(has_f, has_b)
    _state_pass_kernel[geo.pass_grid(nd)](
        st, lg, hs, init_buf, final, bsz, H, NC, P * N,
        DIR0=d0, REV_FIRST=0, HAS_INIT=init is not None, BLOCK=geo.pn_block, **LAUNCH["pass"])
    y = torch.empty_like(x)
    Cf_arg = C_f if has_f else dummy
    Cb_arg = C_b if has_b else dummy
    _chunk_out_kernel[geo.grid](
        x, *args_f[:2], args_f[2], Cf_arg, *args_b[:2], args_b[2], Cb_arg,
        diag if diag is not None else dummy, seg_arg, hs, y, *geo.dims,
        HAS_F=has_f, HAS_B=has_b, HAS_DIAG=diag is not None, HAS_SEG=seg is not None, SHIFT=bool(shift),
        **geo.blocks, **LAUNCH["out"])
    return y, hs, lg, final[0]


def _scan_bwd(dy, dfinal, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, hs, lg, shift: bool,
              chunk_size: int):
    """Backward pass: (dx, ddt_f, dA_f, dB_f, dC_f, ddt_b, dA_b, dB_b, dC_b, ddiag, dinit), float32."""
    has_f, has_b = dt_f is not None, dt_b is not None
    ref_B = B_f if has_f else B_b
    geo = _Geometry(x, ref_B, chunk_size)
    bsz, L, H, G, P, N, NC, Q = geo.dims
    dev = x.device
    f32 = dict(device=dev, dtype=torch.float32)
    dummy = x
    seg_arg = seg if seg is not None else dummy
    dy = dy.contiguous()
    dread = torch.empty(2, bsz, NC, H, P, N, **f32)   # written in full for the present directions
    _chunk_dread_kernel[geo.grid](
        dy, dt_f if has_f else dummy, A_f if has_f else dummy, C_f if has_f else dummy,
        dt_b if has_b else dummy, A_b if has_b else dummy, C_b if has_b else dummy, seg_arg, dread, *geo.dims,
        HAS_F=has_f, HAS_B=has_b, HAS_SEG=seg is not None, SHIFT=bool(shift), **geo.blocks,
        **LAUNCH["dread"])
    # the state gradients obey the states' recurrence run the other way
    ds = torch.empty_like(dread)
    init_buf = torch.zeros(2, bsz, H, P, N, **f32)
    if dfinal is not None:
        init_buf[0] = dfinal.to(torch.float32)
    dinit = torch.empty_like(init_buf)
    d0, nd = _dirs(has_f, has_b)
    _state_pass_kernel[geo.pass_grid(nd)](
        dread, lg, ds, init_buf, dinit, bsz, H, NC, P * N,
        DIR0=d0, REV_FIRST=1, HAS_INIT=dfinal is not None, BLOCK=geo.pn_block, **LAUNCH["pass"])
    per_head = (bsz, L, H, N)

    def grads(has: bool):
        if not has:
            return dummy, dummy, dummy, dummy
        return (torch.empty(per_head, **f32), torch.zeros(per_head, **f32), torch.empty(bsz, L, H, **f32),
                torch.empty(bsz, NC, H, **f32))

    dBf, dCf, ddtf, dAf = grads(has_f)
    dBb, dCb, ddtb, dAb = grads(has_b)
    ddiag = torch.empty(bsz, L, H, **f32) if diag is not None else dummy
    # One launch per direction: a program then holds one direction's tiles only, which halves its registers and
    # compile time; the diagonal rides with the first launch, and the second adds its dx to the first's in place
    # (launches on one stream run in order).
    directions = [d for d, has in ((0, has_f), (1, has_b)) if has]
    dx = torch.empty(bsz, L, H, P, **f32)
    for slot, d in enumerate(directions):
        _chunk_bwd_kernel[geo.grid](
            x, dy, dt_f if d == 0 else dummy, A_f if d == 0 else dummy, B_f if d == 0 else dummy,
            C_f if d == 0 else dummy, dt_b if d == 1 else dummy, A_b if d == 1 else dummy, B_b if d == 1 else dummy,
            C_b if d == 1 else dummy, diag if diag is not None else dummy, seg_arg, hs, ds, lg,
            dx, dBf, dCf, ddtf, dAf, dBb, dCb, ddtb, dAb, ddiag, *geo.dims,
            HAS_F=d == 0, HAS_B=d == 1, HAS_DIAG=diag is not None and slot == 0, HAS_SEG=seg is not None,
            SHIFT=bool(shift), ACC_DX=slot > 0, **geo.blocks, **LAUNCH["bwd"])

    def group_sum(t: Tensor) -> Tensor:
        return t if G == H else t.view(bsz, L, G, H // G, N).sum(3)

    out_f = (ddtf, dAf.sum((0, 1)), group_sum(dBf), group_sum(dCf)) if has_f else (None,) * 4
    out_b = (ddtb, dAb.sum((0, 1)), group_sum(dBb), group_sum(dCb)) if has_b else (None,) * 4
    return (dx, *out_f, *out_b, ddiag if diag is not None else None,
            dinit[0] if has_f else None)


# -- custom ops: opaque to torch.compile (fake kernels), counted by FlopCounterMode --------------------------

@torch.library.custom_op("mixer_plugins::quasiseparable_triton", mutates_args=())
def _qs_op(
    x: Tensor, dt_f: Optional[Tensor], A_f: Optional[Tensor], B_f: Optional[Tensor], C_f: Optional[Tensor],
    dt_b: Optional[Tensor], A_b: Optional[Tensor], B_b: Optional[Tensor], C_b: Optional[Tensor],
    diag: Optional[Tensor], init: Optional[Tensor], seg: Optional[Tensor], shift: bool, chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fused scan forward: (y, entering states (2, b, NC, h, p, n), log carries (2, b, NC, h), final state)."""
    y, hs, lg, final = _scan_fwd(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, init, shift, chunk_size)
    return y, hs, lg, final.clone()


@_qs_op.register_fake
def _qs_op_fake(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init, seg, shift, chunk_size):
    bsz, L, H, P = x.shape
    N = (B_f if B_f is not None else B_b).shape[-1]
    Q = min(int(chunk_size), L)
    NC = -(-L // Q)
    f32 = torch.float32
    return (x.new_empty(x.shape), x.new_empty(2, bsz, NC, H, P, N, dtype=f32), x.new_empty(2, bsz, NC, H, dtype=f32),
            x.new_empty(bsz, H, P, N, dtype=f32))


@torch.library.custom_op("mixer_plugins::quasiseparable_triton_backward", mutates_args=())
def _qs_bwd_op(
    dy: Tensor, dfinal: Optional[Tensor], x: Tensor, dt_f: Optional[Tensor], A_f: Optional[Tensor],
    B_f: Optional[Tensor], C_f: Optional[Tensor], dt_b: Optional[Tensor], A_b: Optional[Tensor],
    B_b: Optional[Tensor], C_b: Optional[Tensor], diag: Optional[Tensor], seg: Optional[Tensor], hs: Tensor,
    lg: Tensor, shift: bool, chunk_size: int,
) -> list[Tensor]:
    """Fused scan backward: [dx, ddt_f, dA_f, dB_f, dC_f, ddt_b, dA_b, dB_b, dC_b, ddiag, dinit] (float32;
    an empty 1-D tensor for each absent input)."""
    out = _scan_bwd(dy, dfinal, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, hs, lg, shift, chunk_size)
    # custom-op outputs own their storage and alias nothing: a fresh empty tensor per absent gradient
    return [x.new_empty(0, dtype=torch.float32) if g is None else g.clone() if g._base is not None else g
            for g in out]


@_qs_bwd_op.register_fake
def _qs_bwd_op_fake(dy, dfinal, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, hs, lg, shift, chunk_size):
    f32 = torch.float32

    def like(t):
        return x.new_empty(0, dtype=f32) if t is None else x.new_empty(t.shape, dtype=f32)

    bsz, L, H, P = x.shape
    N = (B_f if B_f is not None else B_b).shape[-1]
    dinit = x.new_empty(bsz, H, P, N, dtype=f32) if dt_f is not None else x.new_empty(0, dtype=f32)
    return [like(x), like(dt_f), like(A_f), like(B_f), like(C_f), like(dt_b), like(A_b), like(B_b), like(C_b),
            like(diag), dinit]


def _qs_setup_context(ctx, inputs, output):
    x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init, seg, shift, chunk_size = inputs
    _, hs, lg, _ = output
    ctx.save_for_backward(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, hs, lg, init)
    ctx.shift, ctx.chunk_size = shift, chunk_size


def _qs_autograd_backward(ctx, dy, dhs, dlg, dfinal):
    x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, hs, lg, init = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    grads = _qs_bwd_op(dy.contiguous(), dfinal if dt_f is not None else None, x, dt_f, A_f, B_f, C_f, dt_b, A_b,
                       B_b, C_b, diag, seg, hs, lg, ctx.shift, ctx.chunk_size)
    likes = (x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init)
    cast = [None if like is None else g.to(like.dtype) for g, like in zip(grads, likes)]
    return (*cast, None, None, None)


_qs_op.register_autograd(_qs_autograd_backward, setup_context=_qs_setup_context)


def scan_triton_flops(batch: int, length: int, heads: int, head_dim: int, state: int, directions: int,
                      chunk_size: int, backward: bool = False) -> int:
    """FLOPs (2 per multiply-add) of the fused kernels' matmuls; elementwise work is not counted.

    Forward, per direction: C~.B per head (2 L Q h n), chunk states (2 L h p n), state read-out (2 L h p n); once:
    the summed Q x Q block times x (2 L Q h p). Backward: dy.x^T once (2 L Q h p); per direction C~.B, M^T dy,
    dC~ and dB (2 L Q h (n + p + 2 n)), and five (L, p, n) products (read-out gradient, its dC~, x dS, B dS^T and
    the entering-state gradient). L is the length padded to whole chunks.
    """
    q = min(int(chunk_size), length)
    padded = -(-length // q) * q
    if not backward:
        per_dir = 2 * padded * q * heads * state + 4 * padded * heads * head_dim * state
        return batch * (directions * per_dir + 2 * padded * q * heads * head_dim)
    per_dir = 2 * padded * q * heads * (3 * state + head_dim) + 10 * padded * heads * head_dim * state
    return batch * (directions * per_dir + 2 * padded * q * heads * head_dim)


@register_flop_formula(torch.ops.mixer_plugins.quasiseparable_triton)
def _qs_op_flops(x_shape, dt_f_shape, A_f_shape, B_f_shape, C_f_shape, dt_b_shape, *args, out_shape=None,
                 **kwargs) -> int:
    b, l, h, p = x_shape
    n = (B_f_shape if B_f_shape is not None else args[1])[-1]
    directions = int(dt_f_shape is not None) + int(dt_b_shape is not None)
    return scan_triton_flops(b, l, h, p, n, directions, args[-1])


@register_flop_formula(torch.ops.mixer_plugins.quasiseparable_triton_backward)
def _qs_bwd_op_flops(dy_shape, dfinal_shape, x_shape, dt_f_shape, A_f_shape, B_f_shape, C_f_shape, dt_b_shape,
                     A_b_shape, B_b_shape, *args, out_shape=None, **kwargs) -> int:
    b, l, h, p = x_shape
    n = (B_f_shape if B_f_shape is not None else B_b_shape)[-1]
    directions = int(dt_f_shape is not None) + int(dt_b_shape is not None)
    return scan_triton_flops(b, l, h, p, n, directions, args[-1], backward=True)


def scan_triton(
    x: Tensor,
    dt_f: Tensor | None, A_f: Tensor | None, B_f: Tensor | None, C_f: Tensor | None,
    dt_b: Tensor | None = None, A_b: Tensor | None = None, B_b: Tensor | None = None, C_b: Tensor | None = None,
    diag: Tensor | None = None, seq_idx: Tensor | None = None, initial_state: Tensor | None = None, *,
    shift: bool = False, chunk_size: int = 64, return_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The fused scan with ``scan_chunked``'s arguments (dt already prepared), differentiable.

    Either direction may be None (not both). ``initial_state`` / the final state belong to the forward
    direction. The result has ``x``'s dtype; the final state is float32.
    """
    reason = available(x.device)
    if reason is not None:
        raise RuntimeError(f"triton scan unavailable: {reason}")
    if dt_f is None and dt_b is None:
        raise ValueError("scan_triton needs at least one direction")
    if (initial_state is not None or return_final_state) and dt_f is None:
        raise ValueError("initial and final states belong to the forward direction, which is absent")
    def f32(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.float().contiguous()

    y, _, _, final = _qs_op(
        x.contiguous(), f32(dt_f), f32(A_f), _c(B_f), _c(C_f), f32(dt_b), f32(A_b), _c(B_b), _c(C_b), _c(diag),
        None if initial_state is None else initial_state.contiguous(), _segments(seq_idx), bool(shift),
        int(chunk_size))
    return (y, final) if return_final_state else y
