"""The fused chunked scan in Triton, forward and backward (the kernels of the ``triton`` backend, :mod:`.triton`).

Computes exactly what ``mixer_plugins.kernels.quasiseparable`` computes (see :mod:`.reference` for the matrix
entries), for both directions in **one** chunked pass: per chunk of Q tokens (the requested ``chunk_size``, at most
:attr:`ScanGeometry.MAX_CHUNK`), one Q x Q block holds the lower (forward direction), upper (backward direction) and
diagonal parts and is applied with one matmul; between chunks two light state passes run, the forward state left to
right and the backward state right to left. No flipped copy of the input and no doubled batch. Sequences that fit one
chunk run on the stateless kernels of :mod:`.triton_one_chunk` (the backend chooses by shape).

Per head, with the log decays ``a = A * dt`` of a chunk's rows ``0 .. last`` (kept per token: every log decay and
log weight below is a sum of ``a`` over its own span, formed where it is used as a cumsum that starts at the span's
edge, never as the difference of two cumulative sums of the chunk, so it is rounded relative to its own size and an
empty span, the decay between neighbours when shifted, is exactly 0):

* forward (lower) entries inside a chunk: ``C~_i.B_j exp(L_ij) dt_j``, ``L_ij = a_{j+1} + ... + a_i`` (``j <= i``),
  ``... + a_{i-1}`` shifted (``j < i``, ``C~_i = C_{i-1}``): per pair, a masked cumsum along each query's keys;
* backward (upper) entries: ``L_ij = a_i + ... + a_{j-1}`` (``j >= i``), ``a_{i+1} + ...`` shifted (``j > i``,
  ``C~_i = C_{i+1}``);
* forward state entering chunk c: ``H_{c+1} = exp(a_0 + ... + a_last) H_c + sum_j exp(a_{j+1} + ... + a_last) dt_j
  x_j B_j^T``, read as ``exp(a_0 + ... + a_i) H_c C~_i`` (``... + a_{i-1}`` shifted);
* backward state entering chunk c from the right: ``G_{c-1} = exp(a_0 + ... + a_last) G_c + sum_j exp(a_0 + ... +
  a_{j-1}) dt_j x_j B_j^T``, read as ``exp(a_i + ... + a_last) G_c C~_i`` (``a_{i+1} + ...`` shifted).

The gradient of the log decays, ``da_k``, collects what every log weight containing ``a_k`` is given, term by term:
each intra pair's ``S_ij = (dy_i . x_j) M_ij = dLoss/dL_ij`` (from one ``dy x^T`` per chunk, head and direction:
:func:`_dlog_pairs`), each read-out row's and own-state row's term (:func:`_dlog_query`, :func:`_dlog_key`) and the
log carry's; every term enters through one-sided cumsums, never as a total minus a prefix, so it keeps float32
accuracy at any decay. Then ``d dt += A da`` and ``dA = sum_k dt_k da_k``.

Step sizes are prepared inside the kernels (``clamp(softplus(dt + dt_bias), *dt_limit)``, each part optional), and
their gradient is taken back through it there, so the raw ``dt`` goes in and its gradient comes out.

Launches (each kernel's docstring says what its programs do; every grid is one-dimensional, so ``batch * heads`` may
pass 65,535): forward, 3: ``_states_kernel`` (per sequence, chunk and group of heads that share B and C),
``_pass_kernel`` (the inter-chunk recurrence of both directions), ``_out_kernel`` (per sequence, chunk and head);
backward, 4 (+ one small sum of per-chunk partials of dA and d dt_bias): ``_dstate_kernel`` (per group),
``_pass_kernel`` (the same recurrence run the other way), ``_dx_kernel`` (per head), ``_dbc_kernel`` (per group).

Passed states and their gradients are stored in bfloat16 where the inputs are half precision (float32 otherwise);
every sum runs in float32. Offsets are 64-bit (``tokens * heads * head_dim * state / chunk`` and ``tokens * width``
may pass 2^31), and inputs are read through their strides (the block's slices of one projection are not copied).

``seq_idx`` (packed segments): a new segment starts wherever the id changes; pairs across segments are masked inside
a chunk and the states are gated between chunks, so neither direction nor the shift crosses a segment boundary.

Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

import math
from typing import Any, Optional, overload

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._triton._common import available, cdiv, dot_precision, grid_1d, on_device, pow2, tl, triton
from .._triton._common import mm as _mm

__all__ = ["LAUNCH", "ScanGeometry", "available", "scan_triton", "scan_triton_flops", "state_dtype"]

#: Triton launch options (``num_warps``, ``num_stages``) of each kernel. Eight warps and no software pipelining keep
#: every kernel's tiles in registers at sm_90 for half-precision inputs (``benchmarks/gpu/compile_check.py`` reads the
#: registers and spills from the compiled kernels; ``tests/ops/test_triton_compile.py`` asserts none spills).
#: ``benchmarks/gpu/tune.py`` times alternatives on a GPU.
LAUNCH: dict[str, dict[str, int]] = {
    "states": {"num_warps": 8, "num_stages": 1}, "pass": {"num_warps": 4}, "out": {"num_warps": 8, "num_stages": 1},
    "dstate": {"num_warps": 8, "num_stages": 1}, "dx": {"num_warps": 8, "num_stages": 1},
    "dbc": {"num_warps": 8, "num_stages": 1},
}


def _block(n: int) -> int:
    """Block size for a dimension: a power of two, at least 16 (tl.dot's minimum on GPUs)."""
    return max(16, pow2(n))


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the passed states and their gradients are stored in for inputs of ``dtype``: bfloat16 for half
    precision (accumulated in float32, as mamba-ssm keeps them), float32 otherwise."""
    return torch.bfloat16 if dtype in (torch.bfloat16, torch.float16) else torch.float32


class ScanGeometry:
    """Chunks, block sizes and the one-dimensional launch grids of one chunked scan (pure Python: no tensors).

    Programs are numbered with the head (or group) fastest, then the chunk, then the sequence, so that the programs
    that read one group's ``C~ B^T`` and B, C tiles run together."""

    #: elements of a state that one program of the state pass carries
    PASS_BLOCK = 1024
    #: the longest chunk the kernels take: a larger ``chunk_size`` changes nothing but speed (and rounding), and the
    #: kernels keep their chunk-by-chunk tiles in registers at 64 tokens (sequences of one chunk up to 256 tokens run
    #: on the one-chunk kernels)
    MAX_CHUNK = 64

    def __init__(self, batch: int, length: int, heads: int, groups: int, head_dim: int, state: int, chunk: int):
        self.batch, self.length, self.heads, self.groups = int(batch), int(length), int(heads), int(groups)
        self.head_dim, self.state = int(head_dim), int(state)
        self.Q = max(1, min(int(chunk), self.length, self.MAX_CHUNK))
        self.nchunks = cdiv(self.length, self.Q)

    def blocks(self, dtype: torch.dtype) -> dict[str, Any]:
        """Block sizes of the chunk, head and state dimensions (and whether the last two fill their blocks), and the
        matmul precision for inputs of ``dtype``."""
        bp, bn = _block(self.head_dim), _block(self.state)
        return dict(BLOCK_Q=_block(self.Q), BLOCK_P=bp, BLOCK_N=bn, EVEN_P=bp == self.head_dim,
                    EVEN_N=bn == self.state, DOT=dot_precision(dtype))

    def pass_block_of(self, elements: int) -> int:
        """Elements of a state that one program of the state pass carries."""
        return min(self.PASS_BLOCK, pow2(elements))

    def pass_blocks_of(self, elements: int) -> int:
        return cdiv(elements, self.pass_block_of(elements))

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.batch, self.length, self.heads, self.groups, self.head_dim, self.state, self.nchunks, self.Q)

    def head_grid(self) -> tuple[int]:
        """One program per (sequence, chunk, head)."""
        return grid_1d(self.batch * self.nchunks * self.heads, "triton scan")

    def group_grid(self) -> tuple[int]:
        """One program per (sequence, chunk, group of heads)."""
        return grid_1d(self.batch * self.nchunks * self.groups, "triton scan")

    def pass_grid(self, ndirs: int, elements: int) -> tuple[int]:
        """One program per (direction, sequence, head, block of a state of ``elements``)."""
        return grid_1d(ndirs * self.batch * self.heads * self.pass_blocks_of(elements), "triton scan (state pass)")


if triton is not None:

    @triton.jit
    def _chunk_program(PER, NC, Q, L):
        """This program's (sequence b, chunk c, index i, first token t0, tokens left rem) for a grid of one program
        per (sequence, chunk, one of ``PER``): heads or groups, the fastest-moving index."""
        pid = tl.program_id(0).to(tl.int64)
        i = pid % PER
        c = (pid // PER) % NC
        b = pid // PER // NC
        t0 = c * Q
        return b, c, i, t0, (L - t0).to(tl.int32)

    @triton.jit
    def _softplus(v):
        """``log(1 + exp(v))`` as PyTorch computes it (``v`` itself above 20), with log1p's accuracy where ``exp(v)``
        is small (``log(u) * x / (u - 1)`` with ``u = 1 + x``)."""
        ex = tl.exp(tl.minimum(v, 20.0))
        u = 1.0 + ex
        small = tl.where(u == 1.0, ex, tl.log(u) * (ex / tl.where(u == 1.0, 1.0, u - 1.0)))
        return tl.where(v > 20.0, v, small)

    @triton.jit
    def _step(dt_ptr, r, ok, sl, bias_ptr, h, lo, hi,
              HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr):
        """Step sizes ``clamp(softplus(raw + bias), lo, hi)`` at rows ``r`` (each part optional) and their derivative
        with respect to the raw values; both 0 outside ``ok``. ``dt_ptr`` points at the chunk's first row."""
        v = tl.load(dt_ptr + r * sl, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += tl.load(bias_ptr + h).to(tl.float32)
        grad = tl.full(v.shape, 1.0, tl.float32)
        if SOFTPLUS:
            grad = tl.sigmoid(v)
            v = _softplus(v)
        if CLAMP:
            grad = tl.where((v >= lo) & (v <= hi), grad, 0.0)
            v = tl.minimum(tl.maximum(v, lo), hi)
        return tl.where(ok, v, 0.0), tl.where(ok, grad, 0.0)

    @triton.jit
    def _rate(A_ptr, h, A_LOG: tl.constexpr):
        """Head ``h``'s decay rate ``A`` in float32: read as it is, or formed from ``A_log`` as ``-exp(A_log)``
        (``A_LOG``; then ``dA_log = A dA``)."""
        v = tl.load(A_ptr + h).to(tl.float32)
        if A_LOG:
            v = -tl.exp(v)
        return v

    @triton.jit
    def _pick(d: tl.constexpr, forward, backward):
        """``forward`` for direction 0, ``backward`` for direction 1 (chosen when the kernel is compiled)."""
        if d == 0:
            return forward
        else:
            return backward

    @triton.jit
    def _offset(b, t0, k, sb, sl, sk):
        """The element offset of row ``t0`` of sequence ``b``, slice ``k``, in 64 bits (``b``, ``t0``, ``k`` come from
        a 64-bit program id)."""
        return b.to(tl.int64) * sb + t0.to(tl.int64) * sl + k.to(tl.int64) * sk

    @triton.jit
    def _at(ptr, b, t0, k, sb, sl, sk):
        """``ptr`` moved to row ``t0`` of sequence ``b``, slice ``k`` (a 64-bit offset); rows of the chunk are then
        addressed by their 32-bit offsets from there."""
        return ptr + _offset(b, t0, k, sb, sl, sk)

    @triton.jit
    def _tile(ptr, r, ok, offs, W, sl, EVEN: tl.constexpr):
        """The (rows, width) tile at rows ``r`` from ``ptr`` (unit column stride; in its own dtype; 0 outside ``ok``
        and, unless ``EVEN`` (the width fills the block), outside ``W``)."""
        if EVEN:
            m = ok[:, None]
        else:
            m = ok[:, None] & (offs < W)[None, :]
        return tl.load(ptr + (r * sl)[:, None] + offs[None, :], mask=m, other=0.0)

    @triton.jit
    def _store_tile(ptr, r, ok, offs, W, sl, value, EVEN: tl.constexpr):
        if EVEN:
            m = ok[:, None]
        else:
            m = ok[:, None] & (offs < W)[None, :]
        tl.store(ptr + (r * sl)[:, None] + offs[None, :], value.to(ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _square(ptr, offs_p, offs_n, value):
        """Store a state tile at ``ptr`` (a (BLOCK_P, BLOCK_N) block of a buffer padded to blocks: no mask)."""
        tl.store(ptr + offs_p[:, None] * offs_n.shape[0] + offs_n[None, :], value.to(ptr.dtype.element_ty))

    @triton.jit
    def _load_square(ptr, offs_p, offs_n):
        return tl.load(ptr + offs_p[:, None] * offs_n.shape[0] + offs_n[None, :])

    @triton.jit
    def _segments(seg_ptr, b, t0, offs_q, rem, L, Q):
        """Segment numbers of a chunk's rows and of the tokens around it: (rows, first, last, before, after)."""
        row = seg_ptr + b * L + t0
        seg = tl.load(row + tl.minimum(offs_q, rem - 1))
        first = tl.load(row)
        last = tl.load(row + tl.minimum(Q, rem) - 1)
        before = tl.load(row - (t0 > 0).to(tl.int64))
        after = tl.load(row + tl.minimum(Q, rem - 1))
        return seg, first, last, before, after

    @triton.jit
    def _decays(dtc_ptr, base, offs_q, ok, plane):
        """A chunk's prepared step sizes ``dt`` and log decays ``a = A dt`` of one head and direction (0 outside
        ``ok``), as the states kernel stored them at ``dtc`` and ``dtc + plane``. Every log decay and log weight is a
        sum of ``a`` over its own span, formed from these where it is needed (:func:`_pair_logs`,
        :func:`_read_log_weight`, :func:`_own_log_weight`): never a difference of two long cumulative sums."""
        dt = tl.load(dtc_ptr + base + offs_q, mask=ok, other=0.0)
        a = tl.load(dtc_ptr + plane + base + offs_q, mask=ok, other=0.0)
        return dt, a

    @triton.jit
    def _down(v):
        """``v`` one row down: ``w_k = v_{k-1}``, ``w_0 = 0`` (selected, never recomputed)."""
        idx = tl.arange(0, v.shape[0])
        return tl.where(idx == 0, 0.0, tl.gather(v, tl.maximum(idx - 1, 0), 0))

    @triton.jit
    def _up(v):
        """``v`` one row up: ``w_k = v_{k+1}``, 0 in the last row (selected, never recomputed)."""
        idx = tl.arange(0, v.shape[0])
        last = v.shape[0] - 1
        return tl.where(idx == last, 0.0, tl.gather(v, tl.minimum(idx + 1, last), 0))

    @triton.jit
    def _c_rows(d: tl.constexpr, offs_q, ok, t0, rem, SHIFT: tl.constexpr):
        """The rows of C that query rows read in direction ``d`` (0 forward, 1 backward), relative to the chunk's
        first row (``-+ 1`` when shifted), and the mask of those rows."""
        if d == 0:
            if SHIFT:
                return offs_q - 1, ok & ((offs_q >= 1) | (t0 > 0))
            else:
                return offs_q, ok
        else:
            if SHIFT:
                return offs_q + 1, ok & (offs_q + 1 < rem)
            else:
                return offs_q, ok

    @triton.jit
    def _read_log_weight(d: tl.constexpr, a, SHIFT: tl.constexpr):
        """Log weight of each query row's read-out of the state entering its chunk in direction ``d``: ``a`` summed
        from the chunk's edge on the keys' side to the row, a cumsum from that edge: forward ``a_0 + ... + a_i``
        (``... + a_{i-1}`` shifted: the sums one row down, selected), backward ``a_i + ... + a_last`` (``a_{i+1} +
        ...`` shifted). ``a`` is 0 outside the chunk's rows."""
        if d == 0:
            p = tl.cumsum(a, 0)
            if SHIFT:
                return _down(p)
            else:
                return p
        else:
            r = tl.cumsum(a, 0, reverse=True)
            if SHIFT:
                return _up(r)
            else:
                return r

    @triton.jit
    def _own_log_weight(d: tl.constexpr, a):
        """Log weight (before ``dt``) of each row in its chunk's own state in direction ``d``: ``a`` summed from the
        row (excluded) to the chunk's edge on the queries' side, a cumsum from that edge, one row over (selected):
        ``a_{j+1} + ... + a_last`` (forward), ``a_0 + ... + a_{j-1}`` (backward)."""
        if d == 0:
            return _up(tl.cumsum(a, 0, reverse=True))
        else:
            return _down(tl.cumsum(a, 0))

    @triton.jit
    def _pair_logs(d: tl.constexpr, a, ok, SHIFT: tl.constexpr):
        """The log decays ``L_ij`` of direction ``d``'s pairs inside one chunk (or tile) from its log decays ``a``, each
        summed over its own span: ``a_{j+1} + ... + a_i`` (``... + a_{i-1}`` shifted) below the diagonal (forward),
        ``a_i + ... + a_{j-1}`` (``a_{i+1} + ...`` shifted) above it (backward), 0 on the diagonal unless shifted;
        ``-inf`` where a pair is not allowed or a row or column is outside ``ok``. Each row is a masked cumsum of
        ``a`` (one column over) along the keys, toward the query: no difference of two long sums, so an empty span
        (a neighbour, shifted) is exactly 0 and every entry is rounded relative to its own size."""
        ii = tl.arange(0, a.shape[0])[:, None]
        jj = tl.arange(0, a.shape[0])[None, :]
        if d == 0:      # column c holds a_{c+1}; row i sums columns j..i-1 (j..i-2 shifted)
            if SHIFT:
                logs = tl.cumsum(tl.where(jj + 1 < ii, _up(a)[None, :], 0.0), 1, reverse=True)
                allowed = jj < ii
            else:
                logs = tl.cumsum(tl.where(jj < ii, _up(a)[None, :], 0.0), 1, reverse=True)
                allowed = jj <= ii
        else:           # column c holds a_{c-1}; row i sums columns i+1..j (i+2..j shifted)
            if SHIFT:
                logs = tl.cumsum(tl.where(jj > ii + 1, _down(a)[None, :], 0.0), 1)
                allowed = jj > ii
            else:
                logs = tl.cumsum(tl.where(jj > ii, _down(a)[None, :], 0.0), 1)
                allowed = jj >= ii
        return tl.where(allowed & ok[:, None] & ok[None, :], logs, float("-inf"))

    @triton.jit
    def _intra_decay(d: tl.constexpr, a, ok, SHIFT: tl.constexpr):
        """The decays ``exp(L_ij)`` of direction ``d``'s intra-chunk block (:func:`_pair_logs`); 0 where a pair is
        not allowed."""
        return tl.exp(_pair_logs(d, a, ok, SHIFT))

    @triton.jit
    def _dlog_pairs(d: tl.constexpr, S, SHIFT: tl.constexpr):
        """The share ``da_k`` of the log-decay gradient of direction ``d`` that the pairs of one block (chunk or tile)
        give its rows. ``S_ij = dLoss/dL_ij`` of the block's allowed pairs (0 elsewhere); ``a_k`` is in the span of
        pair (i, j) when ``j < k <= i`` (forward; ``j < k < i`` shifted) or ``i <= k < j`` (backward; ``i < k < j``
        shifted), so ``da_k`` sums the pairs whose key is on one side of ``k`` and query on the other: a cumsum of
        ``S`` along each query's keys toward ``k``, summed over the queries beyond ``k``, then moved one row over
        (selected). Every pair enters once, with its own decay: no total minus a prefix."""
        ii = tl.arange(0, S.shape[0])[:, None]
        jj = tl.arange(0, S.shape[0])[None, :]
        if d == 0:      # column c: keys j <= c, queries i >= c + 1 (c + 2 shifted); a_{c+1} gets it
            keys = tl.cumsum(S, 1)
            if SHIFT:
                return _down(tl.sum(tl.where(ii > jj + 1, keys, 0.0), 0))
            else:
                return _down(tl.sum(tl.where(ii > jj, keys, 0.0), 0))
        else:           # column c: keys j >= c, queries i <= c - 1 (c - 2 shifted); a_{c-1} gets it
            keys = tl.cumsum(S, 1, reverse=True)
            if SHIFT:
                return _up(tl.sum(tl.where(ii + 1 < jj, keys, 0.0), 0))
            else:
                return _up(tl.sum(tl.where(ii < jj, keys, 0.0), 0))

    @triton.jit
    def _dlog_query(d: tl.constexpr, pairs, qv, SHIFT: tl.constexpr):
        """The log-decay gradient ``da_k`` of direction ``d`` from the pairs of one block (``pairs``, from
        :func:`_dlog_pairs`) and from terms ``qv_i`` of its query rows whose keys lie beyond the block (before it
        forward, after it backward): ``qv_i``'s log weight runs from the block's edge on the keys' side to row ``i``
        (``i - 1`` forward shifted, ``i + 1`` backward shifted), so ``a_k`` gets a cumsum of ``qv`` over the rows on
        the queries' side of ``k`` (beyond ``k`` shifted: selected one row over)."""
        if d == 0:
            rows = tl.cumsum(qv, 0, reverse=True)     # queries i >= k
            if SHIFT:
                rows = _up(rows)
        else:
            rows = tl.cumsum(qv, 0)                   # queries i <= k
            if SHIFT:
                rows = _down(rows)
        return pairs + rows

    @triton.jit
    def _dlog_key(d: tl.constexpr, kv):
        """The log-decay gradient ``da_k`` of direction ``d`` from terms of a block's key rows whose queries lie
        beyond the block (after it forward, before it backward): ``kv_j``'s log weight runs from row ``j`` (excluded)
        to the block's edge on the queries' side, so ``da_k`` sums ``kv_j`` over ``j < k`` (forward) or ``j > k``
        (backward): an exclusive cumsum, selected one row over, never a sum minus its own term."""
        if d == 0:
            return _down(tl.cumsum(kv, 0))
        else:
            return _up(tl.cumsum(kv, 0, reverse=True))

    @triton.jit
    def _states_kernel(
        x_ptr, sxb, sxl, sxh,
        dtf_ptr, Af_ptr, Bf_ptr, Cf_ptr, dtb_ptr, Ab_ptr, Bb_ptr, Cb_ptr,
        sdb, sdl, sdh, sbb, sbl, sbg, bias_ptr, seg_ptr, st_ptr, lg_ptr, cb_ptr, dtc_ptr,
        BATCH, L, H, G, P, N, NC, Q, lo, hi,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_SEG: tl.constexpr, HAS_BIAS: tl.constexpr,
        SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr, A_LOG: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_P: tl.constexpr,
        EVEN_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, chunk, group), direction by direction: ``C~ B^T`` once, then head by head the prepared step
        sizes and their log decays ``a = A dt`` (kept for the other kernels), each chunk's own state and log carry
        (the chunk's sum of ``a``)."""
        b, c, g, t0, rem = _chunk_program(G, NC, Q, L)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        ok = (offs_q < Q) & (offs_q < rem)
        plane = D1 - D0
        plane = plane * BATCH * H * L
        if HAS_SEG:
            seg, seg_first, seg_last, seg_before, seg_after = _segments(seg_ptr, b, t0, offs_q, rem, L, Q)
        for d in tl.static_range(D0, D1):
            slot = d - D0
            Bt = _tile(_at(_pick(d, Bf_ptr, Bb_ptr), b, t0, g, sbb, sbl, sbg), offs_q, ok, offs_n, N, sbl, EVEN_N)
            rc, c_ok = _c_rows(d, offs_q, ok, t0, rem, SHIFT)
            Ct = _tile(_at(_pick(d, Cf_ptr, Cb_ptr), b, t0, g, sbb, sbl, sbg), rc, c_ok, offs_n, N, sbl, EVEN_N)
            cbp = cb_ptr + (((slot * BATCH + b) * NC + c) * G + g) * BLOCK_Q * BLOCK_Q
            tl.store(cbp + offs_q[:, None] * BLOCK_Q + offs_q[None, :], _mm(Ct, tl.trans(Bt), DOT))
            A_ptr = _pick(d, Af_ptr, Ab_ptr)
            dt_ptr = _pick(d, dtf_ptr, dtb_ptr)
            if HAS_SEG:
                seg_own = _pick(d, seg_last, seg_first)
                carried = seg_own == _pick(d, seg_before, seg_after)
            for hh in range(HG):
                h = g * HG + hh
                dt, unused = _step(_at(dt_ptr, b, t0, h, sdb, sdl, sdh), offs_q, ok, sdl, bias_ptr, h, lo, hi,
                                   HAS_BIAS, SOFTPLUS, CLAMP)
                a = dt * _rate(A_ptr, h, A_LOG)
                vbase = ((slot * BATCH + b) * H + h) * L + t0
                tl.store(dtc_ptr + vbase + offs_q, dt, mask=ok)
                tl.store(dtc_ptr + plane + vbase + offs_q, a, mask=ok)
                w = tl.exp(_own_log_weight(d, a)) * dt
                lg = tl.sum(a, 0)
                if HAS_SEG:
                    w = tl.where(seg == seg_own, w, 0.0)
                    lg = tl.where(carried, lg, float("-inf"))
                x = _tile(_at(x_ptr, b, t0, h, sxb, sxl, sxh), offs_q, ok, offs_p, P, sxl, EVEN_P)
                base = ((slot * BATCH + b) * NC + c) * H + h
                _square(st_ptr + base * BLOCK_P * BLOCK_N, offs_p, offs_n,
                        _mm(tl.trans(x.to(tl.float32) * w[:, None]), Bt, DOT))
                tl.store(lg_ptr + base, lg)

    @triton.jit
    def _pass_kernel(
        st_ptr, lg_ptr, init_ptr, final_ptr, hs_ptr, dlg_ptr, BATCH, H, NC, PN, NBLK,
        D0: tl.constexpr, REVERSE: tl.constexpr, HAS_INIT: tl.constexpr, HAS_FINAL: tl.constexpr,
        CARRY_GRAD: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """In place, for each chunk c: ``st_c <- S`` (the state entering c), then ``S <- exp(lg_c) S + (old st_c)``.

        Buffers are (directions, batch, NC, H, PN); slot 0 is direction ``D0`` (0 forward, 1 backward). Direction d runs
        right to left when ``d + REVERSE`` is odd (the backward pass runs every recurrence the other way). ``init`` /
        ``final``: the forward direction's state before its first chunk / after its last, (batch, H, PN). With
        ``CARRY_GRAD`` (the backward pass, S the gradient of the state after chunk c) also
        ``exp(lg_c) <S, hs_c>`` over this program's block of the state, into ``dlg`` (directions, batch, NC, H,
        NBLK)."""
        pid = tl.program_id(0).to(tl.int64)
        blk = pid % NBLK
        h = (pid // NBLK) % H
        b = (pid // NBLK // H) % BATCH
        slot = pid // NBLK // H // BATCH
        d = D0 + slot
        rev = (d + REVERSE) % 2
        offs = (blk * BLOCK + tl.arange(0, BLOCK)).to(tl.int32)
        m = offs < PN
        io = (b * H + h) * PN
        if HAS_INIT:
            state = tl.load(init_ptr + io + offs, mask=m & (d == 0), other=0.0).to(tl.float32)
        else:
            state = tl.zeros([BLOCK], dtype=tl.float32)
        # a while loop, not range(NC): the 3.5 interpreter cannot turn a runtime scalar into a Python int under NumPy
        # >= 2.3 (it converts a shape-(1,) array with int()); compiled kernels are equivalent
        k = 0
        while k < NC:
            c = k + rev * (NC - 1 - 2 * k)
            base = ((slot * BATCH + b) * NC + c) * H + h
            ptrs = st_ptr + base * PN + offs
            src = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
            gamma = tl.exp(tl.load(lg_ptr + base))
            if CARRY_GRAD:
                hs = tl.load(hs_ptr + base * PN + offs, mask=m, other=0.0).to(tl.float32)
                tl.store(dlg_ptr + base * NBLK + blk, gamma * tl.sum(state * hs, 0))
            tl.store(ptrs, state.to(st_ptr.dtype.element_ty), mask=m)
            state = gamma * state + src
            k += 1
        if HAS_FINAL:
            tl.store(final_ptr + io + offs, state.to(final_ptr.dtype.element_ty), mask=m & (d == 0))

    @triton.jit
    def _out_kernel(
        x_ptr, sxb, sxl, sxh, Cf_ptr, Cb_ptr, sbb, sbl, sbg,
        diag_ptr, sgb, sgl, sgh, seg_ptr, cb_ptr, st_ptr, dtc_ptr, y_ptr,
        BATCH, L, H, G, P, N, NC, Q,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_SEG: tl.constexpr,
        SHIFT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
        EVEN_P: tl.constexpr, EVEN_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, chunk, head): ``y = (lower + upper + diag) @ x + both read-outs of the entering states``;
        the read-outs' log weights are kept at ``dtc + 2 plane`` for the backward (:func:`_dstate_kernel`)."""
        b, c, h, t0, rem = _chunk_program(H, NC, Q, L)
        g = h // HG
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        ok = (offs_q < Q) & (offs_q < rem)
        plane = (D1 - D0) * BATCH * H * L
        if HAS_SEG:
            seg, seg_first, seg_last, seg_before, seg_after = _segments(seg_ptr, b, t0, offs_q, rem, L, Q)
        acc = tl.zeros([BLOCK_Q, BLOCK_P], dtype=tl.float32)
        M = tl.zeros([BLOCK_Q, BLOCK_Q], dtype=tl.float32)
        for d in tl.static_range(D0, D1):
            slot = d - D0
            vbase = ((slot * BATCH + b) * H + h) * L + t0
            dt, a = _decays(dtc_ptr, vbase, offs_q, ok, plane)
            rc, c_ok = _c_rows(d, offs_q, ok, t0, rem, SHIFT)
            read = _read_log_weight(d, a, SHIFT)
            tl.store(dtc_ptr + 2 * plane + vbase + offs_q, read, mask=ok)     # for the backward's read-out gradient
            cbp = cb_ptr + (((slot * BATCH + b) * NC + c) * G + g) * BLOCK_Q * BLOCK_Q
            decay = _intra_decay(d, a, ok, SHIFT)
            if HAS_SEG:
                decay = tl.where(seg[:, None] == seg[None, :], decay, 0.0)
            M += tl.load(cbp + offs_q[:, None] * BLOCK_Q + offs_q[None, :]) * decay * dt[None, :]
            Ct = _tile(_at(_pick(d, Cf_ptr, Cb_ptr), b, t0, g, sbb, sbl, sbg), rc, c_ok, offs_n, N, sbl, EVEN_N)
            Hc = _load_square(st_ptr + (((slot * BATCH + b) * NC + c) * H + h) * BLOCK_P * BLOCK_N, offs_p, offs_n)
            wq = tl.exp(read)
            if HAS_SEG:
                wq = tl.where(seg == _pick(d, seg_before, seg_after), wq, 0.0)
            acc += _mm(Ct, tl.trans(Hc), DOT) * wq[:, None]
        if HAS_DIAG:
            dg = tl.load(_at(diag_ptr, b, t0, h, sgb, sgl, sgh) + offs_q * sgl, mask=ok, other=0.0).to(tl.float32)
            M += tl.where(offs_q[:, None] == offs_q[None, :], dg[:, None], 0.0)
        x = _tile(_at(x_ptr, b, t0, h, sxb, sxl, sxh), offs_q, ok, offs_p, P, sxl, EVEN_P)
        acc += _mm(M, x, DOT)
        _store_tile(y_ptr + ((b * L + t0) * H + h) * P, offs_q, ok, offs_p, P, H * P, acc, EVEN_P)

    @triton.jit
    def _dstate_kernel(
        dy_ptr, syb, syl, syh, Cf_ptr, Cb_ptr, sbb, sbl, sbg,
        seg_ptr, st_ptr, dtc_ptr, ds_ptr, rr_ptr, tacc_ptr,
        BATCH, L, H, G, P, N, NC, Q,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_SEG: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_P: tl.constexpr,
        EVEN_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, chunk, group), direction by direction and head by head: the gradient of the read-out with
        respect to the entering state, ``(w dy)^T C~`` (into ``ds``), the read-out's share of the log-decay gradient
        (``rr``, per head and row), and its share of dC~, ``sum_heads w (dy H)``, into ``tacc`` (directions, batch,
        L, G, N), float32. The read-out's weights ``w = exp(read)`` take the log weights the output kernel kept."""
        b, c, g, t0, rem = _chunk_program(G, NC, Q, L)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        ok = (offs_q < Q) & (offs_q < rem)
        plane = (D1 - D0) * BATCH * H * L
        if HAS_SEG:
            seg, seg_first, seg_last, seg_before, seg_after = _segments(seg_ptr, b, t0, offs_q, rem, L, Q)
        for d in tl.static_range(D0, D1):
            slot = d - D0
            rc, c_ok = _c_rows(d, offs_q, ok, t0, rem, SHIFT)
            Ct = _tile(_at(_pick(d, Cf_ptr, Cb_ptr), b, t0, g, sbb, sbl, sbg), rc, c_ok, offs_n, N, sbl, EVEN_N)
            acc = tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32)
            for hh in range(HG):
                h = g * HG + hh
                read = tl.load(dtc_ptr + 2 * plane + ((slot * BATCH + b) * H + h) * L + t0 + offs_q, mask=ok, other=0.0)
                wq = tl.where(ok, tl.exp(read), 0.0)
                if HAS_SEG:
                    wq = tl.where(seg == _pick(d, seg_before, seg_after), wq, 0.0)
                dy = _tile(_at(dy_ptr, b, t0, h, syb, syl, syh), offs_q, ok, offs_p, P, syl, EVEN_P)
                sbase = (((slot * BATCH + b) * NC + c) * H + h) * BLOCK_P * BLOCK_N
                _square(ds_ptr + sbase, offs_p, offs_n, _mm(tl.trans(dy.to(tl.float32) * wq[:, None]), Ct, DOT))
                T = _mm(dy, _load_square(st_ptr + sbase, offs_p, offs_n), DOT)    # (Q, N): dy H
                tl.store(rr_ptr + ((slot * BATCH + b) * L + t0) * H + h + offs_q * H,
                         wq * tl.sum(T * Ct.to(tl.float32), 1), mask=ok)
                acc += wq[:, None] * T
            _store_tile(tacc_ptr + (((slot * BATCH + b) * L + t0) * G + g) * N, offs_q, ok, offs_n, N, G * N, acc,
                        EVEN_N)

    @triton.jit
    def _dt_grads(d: tl.constexpr, dt, gdt, A, kd, pairs, rr, val, ws_raw, dlg, ok, SHIFT: tl.constexpr):
        """Direction ``d``'s step-size gradients of one head in one chunk: the raw step sizes' (through the decays and
        weights, then through their preparation, whose derivative is ``gdt``) and the chunk's partial of dA.

        ``dt_j`` enters directly through ``kd`` (per key: ``x_j . (M~^T dy)_j``) and the own state's weight
        (``val = rowsum((x dS) B)``), and through ``a = A dt`` into every log weight, each a sum of ``a`` over its own
        span. The log-decay gradient ``da_k`` collects, term by term, what each log weight containing ``a_k`` is
        given: the intra pairs (``pairs``, :func:`_dlog_pairs`), the read-out's ``rr_i`` (log weight from the chunk's
        edge on the keys' side to row ``i``: :func:`_dlog_query`), the own state's ``Rs_j`` (from row ``j`` to the
        edge on the queries' side: :func:`_dlog_key`) and the log carry's ``dlg`` (the whole chunk: every row)."""
        Rs = ws_raw * dt * val
        ddt = kd + ws_raw * val
        da = _dlog_query(d, pairs, rr, SHIFT) + _dlog_key(d, Rs) + dlg
        da = tl.where(ok, da, 0.0)
        return (ddt + A * da) * gdt, tl.sum(dt * da, 0)

    @triton.jit
    def _dx_direction(
        dx, x, dy, seg, seg_first, seg_last, dtf_ptr, Af_ptr, Bf_ptr, dtb_ptr, Ab_ptr, Bb_ptr, sdb, sdl, sdh,
        sbb, sbl, sbg, bias_ptr, cb_ptr, ds_ptr, dtc_ptr, rr_ptr, dlg_ptr, ddtf_ptr, ddtb_ptr, b, c, h, g, t0, rem,
        plane, BATCH, L, H, G, N, NC, Q, NBLK, lo, hi, d: tl.constexpr, D0: tl.constexpr, HAS_SEG: tl.constexpr,
        HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr, A_LOG: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """:func:`_dx_kernel`'s share of direction ``d`` in one chunk and head: ``dx`` with this direction's terms
        added, the sum of its raw step-size gradients (stored here, in dt's dtype) and its partial of dA (of
        ``A_log`` with ``A_LOG``)."""
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        ok = (offs_q < Q) & (offs_q < rem)
        slot = d - D0
        vbase = ((slot * BATCH + b) * H + h) * L + t0
        dt, a = _decays(dtc_ptr, vbase, offs_q, ok, plane)
        cbp = cb_ptr + (((slot * BATCH + b) * NC + c) * G + g) * BLOCK_Q * BLOCK_Q
        Mt = tl.load(cbp + offs_q[:, None] * BLOCK_Q + offs_q[None, :]) * _intra_decay(d, a, ok, SHIFT)
        if HAS_SEG:
            Mt = tl.where(seg[:, None] == seg[None, :], Mt, 0.0)
        Z = _mm(tl.trans(Mt), dy, DOT)                   # (Q, P): Z_j = sum_i M~_ij dy_i
        dx += dt[:, None] * Z
        kd = tl.sum(x.to(tl.float32) * Z, 1)
        # the intra pairs' share of the log-decay gradient, from S_ij = (dy_i . x_j) M_ij = dLoss/dL_ij
        pairs = _dlog_pairs(d, _mm(dy, tl.trans(x), DOT) * Mt * dt[None, :], SHIFT)
        ws_raw = tl.where(ok, tl.exp(_own_log_weight(d, a)), 0.0)
        if HAS_SEG:
            ws_raw = tl.where(seg == _pick(d, seg_last, seg_first), ws_raw, 0.0)
        sbase = ((slot * BATCH + b) * NC + c) * H + h
        dS = _load_square(ds_ptr + sbase * BLOCK_P * BLOCK_N, offs_p, offs_n)
        Bt = _tile(_at(_pick(d, Bf_ptr, Bb_ptr), b, t0, g, sbb, sbl, sbg), offs_q, ok, offs_n, N, sbl, EVEN_N)
        dx += (ws_raw * dt)[:, None] * _mm(Bt, tl.trans(dS), DOT)
        val = tl.sum(_mm(x, dS, DOT) * Bt.to(tl.float32), 1)              # rowsum((x dS) * B)
        if HAS_BIAS or SOFTPLUS or CLAMP:
            unused, gdt = _step(_at(_pick(d, dtf_ptr, dtb_ptr), b, t0, h, sdb, sdl, sdh), offs_q, ok, sdl,
                                bias_ptr, h, lo, hi, HAS_BIAS, SOFTPLUS, CLAMP)
        else:
            gdt = tl.where(ok, 1.0, 0.0)
        rr = tl.load(rr_ptr + ((slot * BATCH + b) * L + t0) * H + h + offs_q * H, mask=ok, other=0.0)
        dlg = tl.sum(tl.load(dlg_ptr + sbase * NBLK + offs_k, mask=offs_k < NBLK, other=0.0), 0)
        A = _rate(_pick(d, Af_ptr, Ab_ptr), h, A_LOG)
        ddt, dA = _dt_grads(d, dt, gdt, A, kd, pairs, rr, val, ws_raw, dlg, ok, SHIFT)
        if A_LOG:
            dA *= A
        ddt_ptr = _pick(d, ddtf_ptr, ddtb_ptr)
        tl.store(ddt_ptr + (b * L + t0) * H + h + offs_q * H, ddt.to(ddt_ptr.dtype.element_ty), mask=ok)
        return dx, tl.sum(ddt, 0), dA

    @triton.jit
    def _dx_kernel(
        x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh,
        dtf_ptr, Af_ptr, Bf_ptr, dtb_ptr, Ab_ptr, Bb_ptr, sdb, sdl, sdh, sbb, sbl, sbg,
        diag_ptr, sgb, sgl, sgh, bias_ptr, seg_ptr, cb_ptr, ds_ptr, dtc_ptr, rr_ptr, dlg_ptr,
        dx_ptr, ddiag_ptr, ddtf_ptr, ddtb_ptr, part_ptr,
        BATCH, L, H, G, P, N, NC, Q, NBLK, lo, hi,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_DIAG: tl.constexpr, HAS_SEG: tl.constexpr,
        HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr, A_LOG: tl.constexpr,
        SHIFT: tl.constexpr, SHARED_A: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_P: tl.constexpr, EVEN_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, chunk, head): ``dx`` (x's dtype), d diag, and each direction's raw step-size gradient (dt's
        dtype) with the chunk's partials of dA and d dt_bias (``part`` (batch * NC, 3, H): dA forward, dA backward,
        d dt_bias). Per direction, with ``M~ = C~B^T * decay`` (the intra block without ``dt``): ``Z = M~^T dy`` gives
        ``dx += dt Z`` and dt's direct gradient ``kd_j = x_j . Z_j``; ``dy x^T`` gives the pairs' ``S_ij = (dy_i .
        x_j) M~_ij dt_j = dLoss/dL_ij`` and from them the intra share of the log-decay gradient
        (:func:`_dlog_pairs`)."""
        b, c, h, t0, rem = _chunk_program(H, NC, Q, L)
        g = h // HG
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        ok = (offs_q < Q) & (offs_q < rem)
        plane = (D1 - D0) * BATCH * H * L
        if HAS_SEG:
            seg, seg_first, seg_last, seg_before, seg_after = _segments(seg_ptr, b, t0, offs_q, rem, L, Q)
        else:   # never read
            seg = offs_q
            seg_first = 0
            seg_last = 0
        dy = _tile(_at(dy_ptr, b, t0, h, syb, syl, syh), offs_q, ok, offs_p, P, syl, EVEN_P)
        x = _tile(_at(x_ptr, b, t0, h, sxb, sxl, sxh), offs_q, ok, offs_p, P, sxl, EVEN_P)
        dx = tl.zeros([BLOCK_Q, BLOCK_P], dtype=tl.float32)
        if HAS_DIAG:
            dg = tl.load(_at(diag_ptr, b, t0, h, sgb, sgl, sgh) + offs_q * sgl, mask=ok, other=0.0).to(tl.float32)
            dx += dg[:, None] * dy.to(tl.float32)
            tl.store(ddiag_ptr + (b * L + t0) * H + h + offs_q * H,
                     tl.sum(dy.to(tl.float32) * x.to(tl.float32), 1).to(ddiag_ptr.dtype.element_ty), mask=ok)
        part = part_ptr + (b * NC + c) * 3 * H + h
        dbias = 0.0
        dA_both = 0.0
        for d in tl.static_range(D0, D1):
            dx, ddt_sum, dA = _dx_direction(
                dx, x, dy, seg, seg_first, seg_last, dtf_ptr, Af_ptr, Bf_ptr, dtb_ptr, Ab_ptr, Bb_ptr, sdb, sdl, sdh,
                sbb, sbl, sbg, bias_ptr, cb_ptr, ds_ptr, dtc_ptr, rr_ptr, dlg_ptr, ddtf_ptr, ddtb_ptr, b, c, h, g, t0,
                rem, plane, BATCH, L, H, G, N, NC, Q, NBLK, lo, hi, d, D0, HAS_SEG, HAS_BIAS, SOFTPLUS, CLAMP, A_LOG,
                SHIFT, BLOCK_Q, BLOCK_P, BLOCK_N, BLOCK_K, EVEN_N, DOT)
            if SHARED_A:   # one A for both directions: one gradient
                dA_both += dA
            else:
                tl.store(part + d * H, dA)
            dbias += ddt_sum
        if SHARED_A:
            tl.store(part, dA_both)
        if HAS_BIAS:
            tl.store(part + 2 * H, dbias)
        _store_tile(dx_ptr + ((b * L + t0) * H + h) * P, offs_q, ok, offs_p, P, H * P, dx, EVEN_P)

    @triton.jit
    def _store_dc(ptr, dC, rc, c_ok, d: tl.constexpr, tile, tiles, rem, N, stride, SHIFT: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
        """Store one tile's dC at the C rows its queries read (``rc``); with the shift, also the zero gradient of
        the C row no query reads (the sequence's last one forward, its first backward)."""
        offs = tl.arange(0, BLOCK)
        offs_n = tl.arange(0, BLOCK_N)
        _store_tile(ptr, rc, c_ok, offs_n, N, stride, dC, EVEN_N)
        if SHIFT:
            if d == 0:
                edge = rem - 1 + offs * 0
                edge_ok = (offs == 0) & (tile == tiles - 1)
            else:
                edge = offs * 0
                edge_ok = (offs == 0) & (tile == 0)
            _store_tile(ptr, edge, edge_ok, offs_n, N, stride, tl.zeros([BLOCK, BLOCK_N], dtype=tl.float32),
                        EVEN_N)

    @triton.jit
    def _dcb_group(
        x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, dtc_ptr, seg, b, g, t0, rem, plane, BATCH, L, H, P, Q,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_SEG: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, EVEN_P: tl.constexpr, DOT: tl.constexpr,
    ):
        """:func:`_dbc_kernel`'s first step: each direction's ``d(C~ B^T)`` of one chunk, summed over the group's
        heads, with ``dy x^T`` formed once per head for both directions."""
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        ok = (offs_q < Q) & (offs_q < rem)
        dCB_f = tl.zeros([BLOCK_Q, BLOCK_Q], dtype=tl.float32)
        dCB_b = tl.zeros([BLOCK_Q, BLOCK_Q], dtype=tl.float32)
        for hh in range(HG):
            h = g * HG + hh
            x = _tile(_at(x_ptr, b, t0, h, sxb, sxl, sxh), offs_q, ok, offs_p, P, sxl, EVEN_P)
            dy = _tile(_at(dy_ptr, b, t0, h, syb, syl, syh), offs_q, ok, offs_p, P, syl, EVEN_P)
            DYX = _mm(dy, tl.trans(x), DOT)                       # [i, j] = dy_i . x_j, once for both directions
            if HAS_SEG:
                DYX = tl.where(seg[:, None] == seg[None, :], DYX, 0.0)
            for d in tl.static_range(D0, D1):
                slot = d - D0
                vbase = ((slot * BATCH + b) * H + h) * L + t0
                dt, a = _decays(dtc_ptr, vbase, offs_q, ok, plane)
                E = DYX * _intra_decay(d, a, ok, SHIFT) * dt[None, :]
                if d == 0:
                    dCB_f += E
                else:
                    dCB_b += E
        return dCB_f, dCB_b

    @triton.jit
    def _db_own_states(
        dB_f, dB_b, x_ptr, sxb, sxl, sxh, ds_ptr, dtc_ptr, seg, seg_first, seg_last, b, c, g, t0, rem, plane,
        BATCH, L, H, P, NC, Q, HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_SEG: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_P: tl.constexpr, DOT: tl.constexpr,
    ):
        """:func:`_dbc_kernel`'s second step: each direction's own-state share of dB in one chunk,
        ``sum_heads w (x dS)``, added to ``dB_f`` and ``dB_b``."""
        offs_q = tl.arange(0, BLOCK_Q)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        ok = (offs_q < Q) & (offs_q < rem)
        for hh in range(HG):
            h = g * HG + hh
            x = _tile(_at(x_ptr, b, t0, h, sxb, sxl, sxh), offs_q, ok, offs_p, P, sxl, EVEN_P)
            for d in tl.static_range(D0, D1):
                slot = d - D0
                vbase = ((slot * BATCH + b) * H + h) * L + t0
                dt, a = _decays(dtc_ptr, vbase, offs_q, ok, plane)
                ws = tl.where(ok, tl.exp(_own_log_weight(d, a)), 0.0) * dt
                if HAS_SEG:
                    ws = tl.where(seg == _pick(d, seg_last, seg_first), ws, 0.0)
                sbase = ((slot * BATCH + b) * NC + c) * H + h
                U = _mm(x, _load_square(ds_ptr + sbase * BLOCK_P * BLOCK_N, offs_p, offs_n), DOT)   # (Q, N): x dS
                if d == 0:
                    dB_f += ws[:, None] * U
                else:
                    dB_b += ws[:, None] * U
        return dB_f, dB_b

    @triton.jit
    def _dbc_kernel(
        x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, Bf_ptr, Cf_ptr, Bb_ptr, Cb_ptr, sbb, sbl, sbg,
        seg_ptr, ds_ptr, dtc_ptr, tacc_ptr, dBf_ptr, dBb_ptr, dCf_ptr, dCb_ptr,
        BATCH, L, H, G, P, N, NC, Q,
        HG: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, HAS_SEG: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_P: tl.constexpr,
        EVEN_N: tl.constexpr, DOT: tl.constexpr,
    ):
        """Per (sequence, chunk, group). First, head by head, ``dy x^T`` (once for both directions) and the group's
        ``d(C~ B^T)``; from it dC (its own dtype; with the read-out's share from ``tacc``) and the intra share of dB.
        Then, head by head, the own states' share of dB, ``sum_heads w (x dS)``; dB last, in its own dtype."""
        b, c, g, t0, rem = _chunk_program(G, NC, Q, L)
        offs_q = tl.arange(0, BLOCK_Q)
        offs_n = tl.arange(0, BLOCK_N)
        ok = (offs_q < Q) & (offs_q < rem)
        plane = (D1 - D0) * BATCH * H * L
        if HAS_SEG:
            seg, seg_first, seg_last, seg_before, seg_after = _segments(seg_ptr, b, t0, offs_q, rem, L, Q)
        else:   # never read
            seg = offs_q
            seg_first = 0
            seg_last = 0
        # 1. d(C~ B^T), summed over the group's heads
        dCB_f, dCB_b = _dcb_group(x_ptr, sxb, sxl, sxh, dy_ptr, syb, syl, syh, dtc_ptr, seg, b, g, t0, rem, plane,
                                  BATCH, L, H, P, Q, HG, D0, D1, HAS_SEG, SHIFT, BLOCK_Q, BLOCK_P, EVEN_P, DOT)
        # dC~ = dCB B + (read-out share), and the intra share of dB = dCB^T C~; C~ rows are C's rows -+ 1 when shifted
        out_rows = ((b * L + t0) * G + g) * N
        dB_f = tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32)
        dB_b = tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32)
        for d in tl.static_range(D0, D1):
            slot = d - D0
            dCB = _pick(d, dCB_f, dCB_b)
            rc, c_ok = _c_rows(d, offs_q, ok, t0, rem, SHIFT)
            Bt = _tile(_at(_pick(d, Bf_ptr, Bb_ptr), b, t0, g, sbb, sbl, sbg), offs_q, ok, offs_n, N, sbl, EVEN_N)
            Ct = _tile(_at(_pick(d, Cf_ptr, Cb_ptr), b, t0, g, sbb, sbl, sbg), rc, c_ok, offs_n, N, sbl, EVEN_N)
            dC_ptr = _pick(d, dCf_ptr, dCb_ptr)
            acc_rows = (((slot * BATCH + b) * L + t0) * G + g) * N
            dC = _mm(dCB, Bt, DOT) + _tile(tacc_ptr + acc_rows, offs_q, ok, offs_n, N, G * N, EVEN_N)
            _store_dc(dC_ptr + out_rows, dC, rc, c_ok, d, c, NC, rem, N, G * N, SHIFT, BLOCK_Q, BLOCK_N, EVEN_N)
            if d == 0:
                dB_f = _mm(tl.trans(dCB), Ct, DOT)
            else:
                dB_b = _mm(tl.trans(dCB), Ct, DOT)
        # 2. head by head: the own states' share of dB
        dB_f, dB_b = _db_own_states(dB_f, dB_b, x_ptr, sxb, sxl, sxh, ds_ptr, dtc_ptr, seg, seg_first, seg_last, b,
                                    c, g, t0, rem, plane, BATCH, L, H, P, NC, Q, HG, D0, D1, HAS_SEG, BLOCK_Q,
                                    BLOCK_P, BLOCK_N, EVEN_P, DOT)
        for d in tl.static_range(D0, D1):
            _store_tile(_pick(d, dBf_ptr, dBb_ptr) + out_rows, offs_q, ok, offs_n, N, G * N, _pick(d, dB_f, dB_b),
                        EVEN_N)


# -- host side ----------------------------------------------------------------------------------------

def _s3(t: Tensor | None) -> tuple[int, int, int]:
    """The first three strides of a (batch, length, k[, width]) tensor (zeros for an absent one)."""
    if t is None:
        return (0, 0, 0)
    stride = t.stride()
    return stride[0], stride[1], stride[2]


def _param(t: Tensor | None) -> Tensor | None:
    """A per-head parameter (h,) with unit stride (a copy only if it has none)."""
    if t is None or t.stride(-1) == 1:
        return t
    return t.contiguous()


@overload
def _unit_last(t: Tensor) -> Tensor: ...
@overload
def _unit_last(t: None) -> None: ...
def _unit_last(t: Tensor | None) -> Tensor | None:
    """``t`` with a unit stride along its last dimension (a copy only if it has none): the kernels' vector loads."""
    if t is None or t.stride(-1) == 1 or t.shape[-1] == 1:
        return t
    return t.contiguous()


def _one_layout(*ts: Tensor | None) -> list[Tensor | None]:
    """The present tensors with one shared set of strides (each as it is when they already share one, contiguous
    otherwise): the kernels take one set of strides for both directions' B and C, and one for both dt."""
    present = [t for t in ts if t is not None]
    if len({t.stride() for t in present}) <= 1 and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in present):
        return list(ts)
    return [None if t is None else t.contiguous() for t in ts]


#: The kernels address a chunk's rows by 32-bit offsets from its first row (every offset of a whole tensor is
#: 64-bit): a row stride times the chunk length must stay under this.
ROW_OFFSET_LIMIT = 2**31


class _Call:
    """What every launch of one scan shares: the present directions, the flags, the geometry, the strides."""

    def __init__(self, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi,
                 softplus, shift, chunk_size, a_log=False):
        self.has_f, self.has_b = dt_f is not None, dt_b is not None
        self.ndirs = int(self.has_f) + int(self.has_b)
        ref_B = B_f if self.has_f else B_b
        b, L, H, P = x.shape
        self.geo = ScanGeometry(b, L, H, ref_B.shape[2], P, ref_B.shape[3], chunk_size)
        self.x, self.diag, self.seg, self.bias = _unit_last(x), diag, seg, _param(dt_bias)
        dt_f, dt_b = _one_layout(dt_f, dt_b)
        B_f, C_f, B_b, C_b = _one_layout(B_f, C_f, B_b, C_b)
        self.dt, self.A = _fill(dt_f, dt_b), _fill(_param(A_f), _param(A_b))
        #: both directions read the forward's A (the caller passed one tensor for both): its gradient is one sum
        self.shared_A = self.has_f and self.has_b and A_b is None
        self.B, self.C = _fill(B_f, B_b), _fill(C_f, C_b)
        rows = [t.stride(1) for t in (self.x, *self.dt, *self.B, diag) if t is not None]
        rows.append(H * P)
        if (max(rows) + 1) * (self.geo.Q + 1) >= ROW_OFFSET_LIMIT:
            raise ValueError(f"triton scan: a token's row stride ({max(rows)} elements) times the chunk length "
                             f"({self.geo.Q}) passes 2^31; use a smaller chunk_size or the torch backend")
        clamp = dt_lo > 0.0 or dt_hi != math.inf
        self.lo_hi = (float(dt_lo), float(dt_hi) if dt_hi != math.inf else 3.0e38)
        self.prep = dict(HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(softplus), CLAMP=bool(clamp), A_LOG=bool(a_log))
        self.flags = dict(HG=H // self.geo.groups, D0=0 if self.has_f else 1, D1=2 if self.has_b else 1,
                          HAS_SEG=seg is not None, SHIFT=bool(shift))
        self.blocks = self.geo.blocks(x.dtype)
        self.pad = (self.blocks["BLOCK_P"], self.blocks["BLOCK_N"])
        self.st_dtype = state_dtype(x.dtype)

    def ptr(self, t: Tensor | None) -> Tensor:
        """A tensor argument (x stands in for an absent one: never read)."""
        return self.x if t is None else t

    def generators(self) -> tuple[Any, ...]:
        """dt, A, B, C of the forward then the backward direction, then the strides of dt and of B and C."""
        (dtf, dtb), (Af, Ab), (Bf, Bb), (Cf, Cb) = self.dt, self.A, self.B, self.C
        return (dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, *_s3(dtf), *_s3(Bf))

    def C_pair(self) -> tuple[Any, ...]:
        return (*self.C, *_s3(self.B[0]))

    def outputs(self, f: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """A forward/backward pair of gradient buffers as the kernels take them (see :func:`_fill`)."""
        return _fill(f if self.has_f else None, b if self.has_b else None)

    @property
    def dims(self) -> tuple[int, ...]:
        return self.geo.dims


def _fill(f: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor]:
    """A forward/backward pair, the present one standing in for an absent one (never read); one must be present."""
    first, second = (b if f is None else f), (f if b is None else b)
    assert first is not None and second is not None, "neither direction is present"
    return first, second


def _grad_buffers(x: Tensor, *ts: Tensor | None) -> list[Tensor]:
    """Uninitialised gradients of ``x`` and ``ts`` in their shapes and dtypes (an empty tensor for an absent one)."""
    return [x.new_empty(0) if t is None else torch.empty(t.shape, device=x.device, dtype=t.dtype) for t in (x, *ts)]


def _padded(t: Tensor, pad: tuple[int, int]) -> Tensor:
    """A (..., P, N) state as the kernels keep it, padded with zeros to (..., BLOCK_P, BLOCK_N)."""
    if tuple(t.shape[-2:]) == pad:
        return t.contiguous()
    return torch.nn.functional.pad(t, (0, pad[1] - t.shape[-1], 0, pad[0] - t.shape[-2])).contiguous()


def _scan_fwd(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init, seg, dt_bias, dt_lo, dt_hi, softplus, shift,
              chunk_size, return_final, a_log=False):
    """Forward pass: (y, the passed states (directions, b, NC, h, BLOCK_P, BLOCK_N), log carries (directions, b, NC,
    h), ``C~ B^T`` (directions, b, NC, g, BLOCK_Q, BLOCK_Q), prepared step sizes, their log decays ``A dt`` and the
    read-outs' log weights (3, directions, b, h, L), the final state (b, h, p, n) float32 or an empty tensor)."""
    k = _Call(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus, shift,
              chunk_size, a_log)
    geo, blocks = k.geo, k.blocks
    bsz, L, H, G, P, N, NC, Q = geo.dims
    BQ, (BP, BN) = blocks["BLOCK_Q"], k.pad
    dev = x.device
    st = torch.empty(k.ndirs, bsz, NC, H, BP, BN, device=dev, dtype=k.st_dtype)
    lg = torch.empty(k.ndirs, bsz, NC, H, device=dev, dtype=torch.float32)
    cb = torch.empty(k.ndirs, bsz, NC, G, BQ, BQ, device=dev, dtype=torch.float32)
    dtc = torch.empty(3, k.ndirs, bsz, H, L, device=dev, dtype=torch.float32)
    final = torch.empty((bsz, H, BP, BN) if return_final else (0,), device=dev, dtype=torch.float32)
    y = torch.empty(x.shape, device=dev, dtype=x.dtype)
    if x.numel() == 0:
        return y, st, lg, cb, dtc, (final[..., :P, :N].contiguous() if return_final else final)
    x = k.x
    with on_device(dev):
        _states_kernel[geo.group_grid()](
            x, *_s3(x), *k.generators(), k.ptr(k.bias), k.ptr(seg), st, lg, cb, dtc, *k.dims, *k.lo_hi,
            **k.flags, **k.prep, **blocks, **LAUNCH["states"])
        _pass_kernel[geo.pass_grid(k.ndirs, BP * BN)](
            st, lg, k.ptr(None if init is None else _padded(init, k.pad)), final, st, lg, bsz, H, NC, BP * BN,
            geo.pass_blocks_of(BP * BN), D0=k.flags["D0"], REVERSE=0, HAS_INIT=init is not None,
            HAS_FINAL=bool(return_final), CARRY_GRAD=False, BLOCK=geo.pass_block_of(BP * BN), **LAUNCH["pass"])
        _out_kernel[geo.head_grid()](
            x, *_s3(x), *k.C_pair(), k.ptr(diag), *_s3(diag), k.ptr(seg), cb, st, dtc, y, *k.dims, **k.flags,
            HAS_DIAG=diag is not None, **blocks, **LAUNCH["out"])
    if return_final and (BP, BN) != (P, N):
        final = final[..., :P, :N].contiguous()
    return y, st, lg, cb, dtc, final


def _scan_bwd(dy, dfinal, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus,
              shift, chunk_size, st, lg, cb, dtc, need_dinit, a_log=False):
    """Backward pass: [dx, ddt_f, dB_f, dC_f, ddt_b, dB_b, dC_b, ddiag, dinit, partials], each gradient in its
    input's dtype (an empty tensor for an absent input); ``partials`` (b * NC, 3, h) float32 hold per-chunk sums of
    dA forward, dA backward and d dt_bias."""
    k = _Call(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi, softplus, shift,
              chunk_size, a_log)
    geo, blocks = k.geo, k.blocks
    bsz, L, H, G, P, N, NC, Q = geo.dims
    BP, BN = k.pad
    dev = x.device
    f32 = dict(device=dev, dtype=torch.float32)
    dx, ddt_f, dB_f, dC_f, ddt_b, dB_b, dC_b, ddiag = _grad_buffers(x, dt_f, B_f, C_f, dt_b, B_b, C_b, diag)
    dinit = torch.empty(bsz, H, BP, BN, **f32) if need_dinit else x.new_empty(0)
    part = torch.empty(bsz * NC, 3, H, **f32)
    if x.numel() == 0:
        dinit = dinit[..., :P, :N].contiguous() if need_dinit else dinit
        return [dx, ddt_f, dB_f, dC_f, ddt_b, dB_b, dC_b, ddiag, dinit, part]
    x, dy = k.x, _unit_last(dy)
    ds = torch.empty(k.ndirs, bsz, NC, H, BP, BN, device=dev, dtype=k.st_dtype)
    rr = torch.empty(k.ndirs, bsz, L, H, **f32)
    tacc = torch.empty(k.ndirs, bsz, L, G, N, **f32)
    nblk = geo.pass_blocks_of(BP * BN)
    dlg = torch.empty(k.ndirs, bsz, NC, H, nblk, **f32)
    with on_device(dev):
        _dstate_kernel[geo.group_grid()](
            dy, *_s3(dy), *k.C_pair(), k.ptr(seg), st, dtc, ds, rr, tacc, *k.dims, **k.flags, **blocks,
            **LAUNCH["dstate"])
        _pass_kernel[geo.pass_grid(k.ndirs, BP * BN)](
            ds, lg, k.ptr(None if dfinal is None else _padded(dfinal, k.pad)), dinit, st, dlg, bsz, H, NC, BP * BN,
            nblk, D0=k.flags["D0"], REVERSE=1, HAS_INIT=dfinal is not None, HAS_FINAL=bool(need_dinit),
            CARRY_GRAD=True, BLOCK=geo.pass_block_of(BP * BN), **LAUNCH["pass"])
        _dx_kernel[geo.head_grid()](
            x, *_s3(x), dy, *_s3(dy), k.dt[0], k.A[0], k.B[0], k.dt[1], k.A[1], k.B[1], *_s3(k.dt[0]),
            *_s3(k.B[0]), k.ptr(diag), *_s3(diag), k.ptr(k.bias), k.ptr(seg), cb, ds, dtc, rr, dlg, dx,
            k.ptr(ddiag if diag is not None else None), *k.outputs(ddt_f, ddt_b), part, *k.dims, nblk, *k.lo_hi,
            **k.flags, HAS_DIAG=diag is not None, **k.prep, SHARED_A=k.shared_A, **blocks, BLOCK_K=max(2, pow2(nblk)),
            **LAUNCH["dx"])
        _dbc_kernel[geo.group_grid()](
            x, *_s3(x), dy, *_s3(dy), k.B[0], k.C[0], k.B[1], k.C[1], *_s3(k.B[0]), k.ptr(seg), ds, dtc, tacc,
            *k.outputs(dB_f, dB_b), *k.outputs(dC_f, dC_b), *k.dims, **k.flags, **blocks, **LAUNCH["dbc"])
    if need_dinit and (BP, BN) != (P, N):
        dinit = dinit[..., :P, :N].contiguous()
    return [dx, ddt_f, dB_f, dC_f, ddt_b, dB_b, dC_b, ddiag, dinit, part]


# -- custom ops: opaque to torch.compile (fake kernels), counted by FlopCounterMode --------------------------

@torch.library.custom_op("mixer_plugins::quasiseparable_triton", mutates_args=())
def _qs_op(
    x: Tensor, dt_f: Optional[Tensor], A_f: Optional[Tensor], B_f: Optional[Tensor], C_f: Optional[Tensor],
    dt_b: Optional[Tensor], A_b: Optional[Tensor], B_b: Optional[Tensor], C_b: Optional[Tensor],
    diag: Optional[Tensor], init: Optional[Tensor], seg: Optional[Tensor], dt_bias: Optional[Tensor],
    dt_lo: float, dt_hi: float, softplus: bool, shift: bool, chunk_size: int, return_final: bool, a_log: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The fused scan's forward (:func:`_scan_fwd`); the two directions' generators share dtypes."""
    return tuple(_scan_fwd(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init, seg, dt_bias, dt_lo, dt_hi,
                           softplus, shift, chunk_size, return_final, a_log))


@_qs_op.register_fake
def _qs_op_fake(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init, seg, dt_bias, dt_lo, dt_hi, softplus,
                shift, chunk_size, return_final, a_log=False):
    bsz, L, H, P = x.shape
    ref_B = B_f if B_f is not None else B_b
    geo = ScanGeometry(bsz, L, H, ref_B.shape[2], P, ref_B.shape[3], chunk_size)
    nd = int(dt_f is not None) + int(dt_b is not None)
    f32 = torch.float32
    blocks = geo.blocks(x.dtype)
    bq, bp, bn = blocks["BLOCK_Q"], blocks["BLOCK_P"], blocks["BLOCK_N"]
    return (x.new_empty(x.shape), x.new_empty(nd, bsz, geo.nchunks, H, bp, bn, dtype=state_dtype(x.dtype)),
            x.new_empty(nd, bsz, geo.nchunks, H, dtype=f32),
            x.new_empty(nd, bsz, geo.nchunks, geo.groups, bq, bq, dtype=f32),
            x.new_empty(3, nd, bsz, H, L, dtype=f32),
            x.new_empty((bsz, H, P, geo.state) if return_final else (0,), dtype=f32))


@torch.library.custom_op("mixer_plugins::quasiseparable_triton_backward", mutates_args=())
def _qs_bwd_op(
    dy: Tensor, dfinal: Optional[Tensor], x: Tensor, dt_f: Optional[Tensor], A_f: Optional[Tensor],
    B_f: Optional[Tensor], C_f: Optional[Tensor], dt_b: Optional[Tensor], A_b: Optional[Tensor],
    B_b: Optional[Tensor], C_b: Optional[Tensor], diag: Optional[Tensor], seg: Optional[Tensor],
    dt_bias: Optional[Tensor], dt_lo: float, dt_hi: float, softplus: bool, shift: bool, chunk_size: int,
    states: Tensor, lg: Tensor, cb: Tensor, dtc: Tensor, need_dinit: bool, a_log: bool = False,
) -> list[Tensor]:
    """The fused scan's backward (:func:`_scan_bwd`); the partials are summed by the caller."""
    return _scan_bwd(dy, dfinal, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi,
                     softplus, shift, chunk_size, states, lg, cb, dtc, need_dinit, a_log)


@_qs_bwd_op.register_fake
def _qs_bwd_op_fake(dy, dfinal, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, dt_lo, dt_hi,
                    softplus, shift, chunk_size, states, lg, cb, dtc, need_dinit, a_log=False):
    bsz, L, H, P = x.shape
    N = (B_f if B_f is not None else B_b).shape[-1]
    dinit = x.new_empty(bsz, H, P, N, dtype=torch.float32) if need_dinit else x.new_empty(0)
    part = x.new_empty(bsz * states.shape[2], 3, H, dtype=torch.float32)
    return [*_grad_buffers(x, dt_f, B_f, C_f, dt_b, B_b, C_b, diag), dinit, part]


_INPUTS = ("x", "dt_f", "A_f", "B_f", "C_f", "dt_b", "A_b", "B_b", "C_b", "diag", "init", "seg", "dt_bias")
#: the gradients a backward op returns, in order (then, in the chunked one, "init"; then the partials)
_GRADS = ("x", "dt_f", "B_f", "C_f", "dt_b", "B_b", "C_b", "diag")


def _save(ctx, tensors, aux, options, a_log: bool) -> None:
    """Keeps an op's input ``tensors`` and its auxiliary outputs ``aux`` (which carry no gradient) for the backward;
    absent gradients stay None (no zero-filled tensors)."""
    ctx.save_for_backward(*tensors, *aux)
    ctx.options, ctx.a_log = tuple(options), a_log
    ctx.mark_non_differentiable(*aux)
    ctx.set_materialize_grads(False)


def _input_grads(ctx, names: tuple[str, ...], grads: list[Tensor], grad_names: tuple[str, ...]) -> tuple[Any, ...]:
    """The backward's result: each input's gradient (``grads`` named ``grad_names``, then the partials of dA forward,
    dA backward and d dt_bias, summed here) in its dtype where the input needs one, else None; None for the options
    after the ``names`` inputs."""
    inputs = dict(zip(names, ctx.saved_tensors))
    got = dict(zip(grad_names, grads))
    got["A_f"], got["A_b"], got["dt_bias"] = grads[-1].sum(0)
    asked = [got[name].to(inputs[name].dtype) if need else None for name, need in zip(names, ctx.needs_input_grad)]
    return (*asked, *(None,) * (len(ctx.needs_input_grad) - len(names)))


def _qs_setup_context(ctx, inputs, output):
    _, states, lg, cb, dtc, final = output
    _save(ctx, inputs[:13], (states, lg, cb, dtc), inputs[13:18], inputs[19])
    if not inputs[18]:   # return_final
        ctx.mark_non_differentiable(final)


def _qs_autograd_backward(ctx, dy, dstates, dlg, dcb, ddtc, dfinal):
    x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init, seg, dt_bias, states, lg, cb, dtc = ctx.saved_tensors
    if dy is None:   # only the final state was used
        dy = torch.zeros_like(x)
    dfinal = None if dfinal is None or dt_f is None else dfinal.contiguous()
    grads = _qs_bwd_op(dy, dfinal, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seg, dt_bias, *ctx.options,
                       states, lg, cb, dtc, bool(ctx.needs_input_grad[10]), ctx.a_log)
    return _input_grads(ctx, _INPUTS, grads, (*_GRADS, "init"))


_qs_op.register_autograd(_qs_autograd_backward, setup_context=_qs_setup_context)


def scan_triton_flops(batch: int, length: int, heads: int, head_dim: int, state: int, directions: int,
                      chunk_size: int, backward: bool = False, groups: int = 1) -> int:
    """FLOPs (2 per multiply-add) of the fused kernels' matmuls; elementwise work is not counted.

    Forward, per direction: ``C~ B^T`` once per group (2 L Q g n), chunk states (2 L h p n), state read-out
    (2 L h p n); once: the summed Q x Q block times x (2 L Q h p). Backward: ``dy x^T`` once (2 L Q h p) and ``M^T
    dy`` once (2 L Q h p); per direction five (L, p, n) products per head (read-out gradient, ``dy H``, ``x dS``,
    ``B dS^T``) and dC~, dB per group (2 x 2 L Q g n). L is the length padded to whole chunks.
    """
    q = ScanGeometry(batch, length, heads, groups, head_dim, state, chunk_size).Q
    padded = -(-length // q) * q
    if not backward:
        per_dir = 2 * padded * q * groups * state + 4 * padded * heads * head_dim * state
        return batch * (directions * per_dir + 2 * padded * q * heads * head_dim)
    per_dir = 4 * padded * q * groups * state + 8 * padded * heads * head_dim * state
    return batch * (directions * per_dir + 4 * padded * q * heads * head_dim)


def _flop_shapes(x_shape, dt_f_shape, A_f_shape, B_f_shape, C_f_shape, dt_b_shape, A_b_shape, B_b_shape,
                 *args) -> dict[str, Any]:
    """An op's sizes, from its arguments' shapes, as the FLOP counts take them."""
    b, l, h, p = x_shape
    g, n = (B_f_shape if B_f_shape is not None else B_b_shape)[2:]
    return dict(batch=b, length=l, heads=h, head_dim=p, state=n, groups=g,
                directions=int(dt_f_shape is not None) + int(dt_b_shape is not None))


@register_flop_formula(torch.ops.mixer_plugins.quasiseparable_triton)
def _qs_op_flops(*shapes, out_shape=None, **kwargs) -> int:
    return scan_triton_flops(**_flop_shapes(*shapes), chunk_size=shapes[17])


@register_flop_formula(torch.ops.mixer_plugins.quasiseparable_triton_backward)
def _qs_bwd_op_flops(dy_shape, dfinal_shape, *shapes, out_shape=None, **kwargs) -> int:
    return scan_triton_flops(**_flop_shapes(*shapes), chunk_size=shapes[16], backward=True)


def _seg_arg(seq_idx: Tensor | None) -> Tensor | None:
    """Normalised segment ids (int32, (b, l), unit stride; :func:`..inputs.normalize_seq_idx`) as the kernels read
    them."""
    if seq_idx is None:
        return None
    return seq_idx if seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() else \
        seq_idx.to(torch.int32).contiguous()


def _backward_generators(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b) -> tuple[Any, ...]:
    """The backward direction's generators as the kernels take them: in the forward's dtypes (one dtype per
    generator), and ``A_b`` None when it is the forward's tensor itself (then its gradient is one sum, not two
    added). Raises when the kernels cannot run on ``x``'s device or neither direction is given."""
    reason = available(x.device)
    if reason is not None:
        raise RuntimeError(f"triton scan unavailable: {reason}")
    if dt_f is None and dt_b is None:
        raise ValueError("a triton scan needs at least one direction")
    if dt_f is None or dt_b is None:
        return dt_b, A_b, B_b, C_b
    if A_b is A_f:
        A_b = None
    return tuple(t if t is None or t.dtype == f.dtype else t.to(f.dtype)
                 for t, f in zip((dt_b, A_b, B_b, C_b), (dt_f, A_f, B_f, C_f)))


def scan_triton(
    x: Tensor,
    dt_f: Tensor | None, A_f: Tensor | None, B_f: Tensor | None, C_f: Tensor | None,
    dt_b: Tensor | None = None, A_b: Tensor | None = None, B_b: Tensor | None = None, C_b: Tensor | None = None,
    diag: Tensor | None = None, seq_idx: Tensor | None = None, initial_state: Tensor | None = None, *,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
    shift: bool = False, chunk_size: int = 64, return_final_state: bool = False, a_log: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The fused chunked scan, differentiable: raw step sizes ``dt_*`` prepared in the kernels as
    ``clamp(softplus?(dt + dt_bias), *dt_limit)``; ``seq_idx`` normalised segment ids (``normalize_seq_idx``);
    ``a_log``: ``A_f``/``A_b`` hold ``A_log``, and the kernels form ``A = -exp(A_log)`` (its gradient is A_log's).

    Either direction may be None (not both). ``initial_state`` / the final state belong to the forward direction.
    Every tensor is read through its strides. The result has ``x``'s dtype; the final state is float32.
    """
    dt_b, A_b, B_b, C_b = _backward_generators(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b)
    if (initial_state is not None or return_final_state) and dt_f is None:
        raise ValueError("initial and final states belong to the forward direction, which is absent")
    init = None if initial_state is None else initial_state.contiguous()
    lo, hi = dt_limit
    y, _, _, _, _, final = _qs_op(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init, _seg_arg(seq_idx), dt_bias,
                               float(lo), float(hi), bool(dt_softplus), bool(shift), int(chunk_size),
                               bool(return_final_state), bool(a_log))
    return (y, final) if return_final_state else y
