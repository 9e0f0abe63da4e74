"""Fused depthwise short convolution (+ SiLU) in Triton: one kernel forward, one kernel backward plus one small
reduction (the ``triton`` backend of :func:`mixer_plugins.kernels.depthwise_conv1d`).

On x (batch, length, channels), weight (channels, k), optional bias (channels,), with ``left`` zeros before the
sequence (``k - 1`` causal, ``(k - 1) // 2`` centred) and ``right = k - 1 - left`` after it::

    pre[b, t, c] = bias[c] + sum_tap weight[c, tap] * x[b, t + tap - left, c]      (x = 0 outside [0, length))
    out = silu(pre) if silu else pre

Forward: one program computes a (``BLOCK_T`` times, ``BLOCK_C`` channels) tile of one sequence: k shifted, masked
loads of x (the neighbouring rows come from cache), multiply-adds in float32, the SiLU, one store in x's dtype. x may
be a strided view (the block passes a slice of its input projection; one whose channels are not adjacent is copied
first); the output is contiguous. The weight goes in taps first ((k, channels), one small copy per call), so that
each tap's channel vector is one vectorized load.

Backward, with ``g`` the output gradient and ``g' = g silu'(pre)`` (or ``g``): ``dx[s] = sum_j weight[:, j]
g'[s + left - j]``, ``dweight[:, tap] = sum_{b,t} g'[t] x[t + tap - left]``, ``dbias = sum_{b,t} g'[t]``. With the
SiLU the pre-activation is recomputed where it is needed (k rows of g' per output row, each k multiply-adds): nothing
is stored by the forward but its output. The weight and bias gradients are sums over batch and time: a fixed number
of programs (a few per SM) each take one channel block and a contiguous range of (sequence, time tile) pairs, keep
their sums in registers and write one float32 partial each; :func:`_sum_partials_kernel` adds the partials in a
fixed order and writes both gradients in their parameters' dtypes (no atomics: reproducible).

Offsets are 64-bit before any multiplication by a stride; the grids are one-dimensional. Both directions are
``torch.library`` custom ops with fake kernels and FLOP formulas. Run on CUDA, or on CPU tensors with
``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._triton._common import available, cdiv, grid_1d, offset64, on_device, pow2, require, rows_last, tl, triton
from ..norm.triton_kernels import persistent_programs
from .torch import _taps_first, register_flops

__all__ = ["MAX_TAPS", "available", "backward_layout", "depthwise_conv1d_triton", "forward_layout"]

#: most taps the kernels take (with the SiLU the backward's work grows as k x k); longer kernels run on torch
MAX_TAPS = 16
#: time and channel tile of the forward kernel, and its warps
FORWARD_TILE = (32, 64, 4)
#: time and channel tile of the backward kernel, and its warps
BACKWARD_TILE = (16, 64, 4)


def _tiles(length: int, channels: int, tile: tuple[int, int, int]) -> tuple[int, int, int, int, int]:
    """``(BLOCK_T, BLOCK_C, num_warps, time tiles, channel blocks)``: ``tile`` narrowed to small inputs."""
    block_t, block_c, warps = tile
    block_t = min(block_t, max(8, pow2(length)))
    block_c = min(block_c, max(8, pow2(channels)))
    return block_t, block_c, warps, cdiv(length, block_t), cdiv(channels, block_c)


def forward_layout(batch: int, length: int, channels: int) -> tuple[tuple[int], dict[str, int]]:
    """The forward's one-dimensional grid (one program per sequence, time tile and channel block) and its block
    sizes, ``num_warps`` and tile counts."""
    block_t, block_c, warps, nt, ncb = _tiles(length, channels, FORWARD_TILE)
    grid = grid_1d(batch * nt * ncb, "depthwise_conv1d (triton)")
    return grid, dict(BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps, NT=nt, NCB=ncb)


def backward_layout(batch: int, length: int, channels: int, programs: int) -> tuple[tuple[int], dict[str, int]]:
    """The backward's one-dimensional grid and block sizes: channel blocks times ``splits`` ranges of
    ``items_per_program`` (sequence, time tile) pairs each, about ``programs`` programs in all, none empty."""
    block_t, block_c, warps, nt, ncb = _tiles(length, channels, BACKWARD_TILE)
    items = batch * nt
    splits = min(max(1, programs // ncb), max(items, 1))
    per = max(1, cdiv(items, splits))
    splits = max(1, cdiv(items, per))
    grid = grid_1d(ncb * splits, "depthwise_conv1d backward (triton)")
    return grid, dict(BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps, NT=nt, NCB=ncb, ITEMS=items,
                      items_per_program=per, splits=splits)


if triton is not None:

    @triton.jit
    def _pre_activation(x_base, w_ptr, bias_ptr, t, c, cmask, L, C, stride_xt, K, LEFT, HAS_BIAS: tl.constexpr):
        """The convolution (before the SiLU) at rows ``t`` and channels ``c`` of one sequence (``x_base``), float32
        (BLOCK_T, BLOCK_C); ``w_ptr``: the weight taps first (K, C). Rows of ``t`` outside the sequence get whatever
        their in-range taps give."""
        if HAS_BIAS:
            acc = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32) + tl.load(
                bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        else:
            acc = tl.zeros([t.shape[0], c.shape[0]], dtype=tl.float32)
        # K is a runtime value and the tap loops are while loops: unrolled (as a constant trip count would be), all
        # their loads are issued at once and the registers run out; and the interpreter cannot run range() over a
        # runtime scalar
        tap = 0
        while tap < K:
            src = t + (tap - LEFT)
            m = ((src >= 0) & (src < L))[:, None] & cmask[None, :]
            xv = tl.load(x_base + offset64(src, stride_xt)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + tap * C + c, mask=cmask, other=0.0).to(tl.float32)
            acc += xv * wv[None, :]
            tap += 1
        return acc

    @triton.jit
    def _conv_fwd_kernel(
        x_ptr, w_ptr, bias_ptr, out_ptr, L, C, NT, NCB,
        stride_xb, stride_xt, stride_ob, stride_ot,
        K, LEFT, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cb = pid % NCB
        rest = pid // NCB
        tb = rest % NT
        b = rest // NT
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < C
        acc = _pre_activation(x_ptr + offset64(b, stride_xb), w_ptr, bias_ptr, t, c, cmask, L, C, stride_xt, K,
                              LEFT, HAS_BIAS)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        m = (t < L)[:, None] & cmask[None, :]
        out = out_ptr + offset64(b, stride_ob) + offset64(t, stride_ot)[:, None] + c[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _conv_bwd_kernel(
        g_ptr, x_ptr, w_ptr, bias_ptr, dx_ptr, part_ptr, L, C, NT, NCB, ITEMS, items_per_program,
        stride_gb, stride_gt, stride_xb, stride_xt, stride_db, stride_dt,
        K, LEFT, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Program (split, channel block): the input gradient of its (sequence, time tile) pairs, and the partial
        sums of the weight gradient (rows 0..K-1) and the bias gradient (row K) over them, written to
        ``part_ptr[split]`` (splits, K + 1, C), float32."""
        pid = tl.program_id(0)
        cb = pid % NCB
        split = pid // NCB
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < C
        kk = tl.arange(0, BLOCK_K)[:, None]
        sums = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
        item = offset64(split, items_per_program)
        end = tl.minimum(item + items_per_program, ITEMS)
        while item < end:
            b = item // NT
            s = (item % NT) * BLOCK_T + tl.arange(0, BLOCK_T)
            x_base = x_ptr + offset64(b, stride_xb)
            g_base = g_ptr + offset64(b, stride_gb)
            dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            j = 0
            while j < K:   # g' at rows t = s + LEFT - j, which tap j carries into row s of dx
                t = s + (LEFT - j)
                tm = ((t >= 0) & (t < L))[:, None] & cmask[None, :]
                gt = tl.load(g_base + offset64(t, stride_gt)[:, None] + c[None, :], mask=tm, other=0.0).to(tl.float32)
                if SILU:
                    pre = _pre_activation(x_base, w_ptr, bias_ptr, t, c, cmask, L, C, stride_xt, K, LEFT, HAS_BIAS)
                    sig = tl.sigmoid(pre)
                    gt = gt * sig * (1.0 + pre * (1.0 - sig))
                wj = tl.load(w_ptr + j * C + c, mask=cmask, other=0.0).to(tl.float32)
                dx += gt * wj[None, :]
                if j == LEFT:   # t == s: this tile's own rows of g', for the weight and bias gradients
                    if HAS_BIAS:
                        sums += tl.where(kk == K, tl.sum(gt, 0)[None, :], 0.0)
                    tap = 0
                    while tap < K:
                        src = s + (tap - LEFT)
                        xm = ((src >= 0) & (src < L))[:, None] & cmask[None, :]
                        xv = tl.load(x_base + offset64(src, stride_xt)[:, None] + c[None, :], mask=xm,
                                     other=0.0).to(tl.float32)
                        sums += tl.where(kk == tap, tl.sum(gt * xv, 0)[None, :], 0.0)
                        tap += 1
                j += 1
            dm = (s < L)[:, None] & cmask[None, :]
            dst = dx_ptr + offset64(b, stride_db) + offset64(s, stride_dt)[:, None] + c[None, :]
            tl.store(dst, dx.to(dx_ptr.dtype.element_ty), mask=dm)
            item += 1
        pm = (kk <= K) & cmask[None, :]
        tl.store(part_ptr + offset64(split, (K + 1) * C) + kk * C + c[None, :], sums, mask=pm)

    @triton.jit
    def _sum_partials_kernel(part_ptr, dw_ptr, db_ptr, SPLITS, C, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
        """``dw[c, tap] = sum_split part[split, tap, c]`` and ``db[c] = sum_split part[split, K, c]``, in a fixed
        order, stored in the dtypes of ``dw_ptr`` (C, K) and ``db_ptr`` (C,)."""
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        kk = tl.arange(0, BLOCK_K)[:, None]
        m = (kk <= K) & (c < C)[None, :]
        acc = tl.zeros([BLOCK_K, BLOCK_C], dtype=tl.float32)
        i = 0
        while i < SPLITS:
            acc += tl.load(part_ptr + offset64(i, (K + 1) * C) + kk * C + c[None, :], mask=m, other=0.0)
            i += 1
        wm = (kk < K) & (c < C)[None, :]
        tl.store(dw_ptr + c[None, :] * K + kk, acc.to(dw_ptr.dtype.element_ty), mask=wm)
        if HAS_BIAS:
            tl.store(db_ptr + c, tl.sum(tl.where(kk == K, acc, 0.0), 0).to(db_ptr.dtype.element_ty), mask=c < C)


def _check_pads(weight: Tensor, left: int, right: int) -> int:
    k = weight.shape[1]
    if left < 0 or right < 0 or left + right != k - 1:
        raise ValueError(f"depthwise_conv1d (triton): pads ({left}, {right}) must add up to kernel - 1 = {k - 1}")
    if k > MAX_TAPS:
        raise ValueError(f"depthwise_conv1d (triton): kernel {k} is over the kernels' limit {MAX_TAPS}")
    return k


def _conv_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int, silu: bool) -> Tensor:
    k = _check_pads(weight, left, right)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    batch, length, channels = x.shape
    grid, blocks = forward_layout(batch, length, channels)
    nt, ncb = blocks.pop("NT"), blocks.pop("NCB")
    x, taps = rows_last(x), _taps_first(weight)
    with on_device(x.device):
        _conv_fwd_kernel[grid](
            x, taps, taps if bias is None else bias, out, length, channels, nt, ncb,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), k, left,
            HAS_BIAS=bias is not None, SILU=bool(silu), **blocks)
    return out


def _conv_bwd(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int,
              silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    k = _check_pads(weight, left, right)
    batch, length, channels = x.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)
    db = x.new_empty(0, dtype=weight.dtype) if bias is None else torch.empty(bias.shape, dtype=bias.dtype,
                                                                              device=x.device)
    if dx.numel() == 0:
        return dx, dw.zero_(), db.zero_()
    grid, blocks = backward_layout(batch, length, channels, persistent_programs(x.device))
    splits, nt, ncb = blocks.pop("splits"), blocks.pop("NT"), blocks.pop("NCB")
    items, per = blocks.pop("ITEMS"), blocks.pop("items_per_program")
    block_k = pow2(k + 1)
    part = torch.empty(splits, k + 1, channels, dtype=torch.float32, device=x.device)
    grad, x, taps = rows_last(grad), rows_last(x), _taps_first(weight)
    with on_device(x.device):
        _conv_bwd_kernel[grid](
            grad, x, taps, taps if bias is None else bias, dx, part, length, channels, nt, ncb, items, per,
            grad.stride(0), grad.stride(1), x.stride(0), x.stride(1), dx.stride(0), dx.stride(1), k, left,
            HAS_BIAS=bias is not None, SILU=bool(silu), BLOCK_K=block_k, **blocks)
        _sum_partials_kernel[(cdiv(channels, blocks["BLOCK_C"]),)](
            part, dw, dw if bias is None else db, splits, channels, K=k, HAS_BIAS=bias is not None,
            BLOCK_C=blocks["BLOCK_C"], BLOCK_K=block_k)
    return dx, dw, db


@torch.library.custom_op("mixer_plugins::depthwise_conv1d_triton", mutates_args=())
def _conv_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int, silu: bool) -> Tensor:
    """Fused depthwise convolution forward (+ SiLU); x's dtype, contiguous."""
    return _conv_fwd(x, weight, bias, left, right, silu)


@_conv_op.register_fake
def _conv_op_fake(x, weight, bias, left, right, silu):
    return x.new_empty(x.shape)


@torch.library.custom_op("mixer_plugins::depthwise_conv1d_triton_backward", mutates_args=())
def _conv_bwd_op(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int,
                 silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Fused depthwise convolution backward: (dx, dweight, dbias) in the dtypes of x, weight and bias (dbias an empty
    tensor without a bias)."""
    return _conv_bwd(grad, x, weight, bias, left, right, silu)


@_conv_bwd_op.register_fake
def _conv_bwd_op_fake(grad, x, weight, bias, left, right, silu):
    db = x.new_empty(0, dtype=weight.dtype) if bias is None else bias.new_empty(bias.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _setup_context(ctx, inputs, output):
    x, weight, bias, left, right, silu = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.pads, ctx.silu = (left, right), silu


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = _conv_bwd_op(grad, x, weight, bias, *ctx.pads, ctx.silu)
    return dx, dw, (None if bias is None else db), None, None, None


_conv_op.register_autograd(_backward, setup_context=_setup_context)

register_flops(torch.ops.mixer_plugins.depthwise_conv1d_triton,
               torch.ops.mixer_plugins.depthwise_conv1d_triton_backward)


def depthwise_conv1d_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int,
                            silu: bool = False) -> Tensor:
    """Depthwise convolution over time of ``x`` (batch, length, channels) with ``weight`` (channels, k) (at most
    :data:`MAX_TAPS` taps), ``left`` / ``right`` zeros around the sequence, then SiLU when ``silu``; as
    :func:`mixer_plugins.kernels.depthwise_conv1d`. Differentiable in x, weight and bias; returns x's dtype."""
    require(x.device, "depthwise_conv1d")
    return _conv_op(x, weight, bias, int(left), int(right), bool(silu))
