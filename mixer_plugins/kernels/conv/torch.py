"""``torch`` form of :func:`..depthwise_conv1d`: shifted multiply-adds, tile by tile, as a custom op.

The block's short convolution (kernel 4-7 over thousands of channels) is a handful of shifted multiply-adds: on the
(batch, length, channels) layout the block already has, forward and backward are a few vectorized passes, with no
transposes (PyTorch's CPU depthwise ``conv1d`` backward is far slower). They run tile by tile along time: full-size
temporaries would each be a fresh ``mmap``'ed allocation on CPU, whose page faults cost several times the arithmetic.
The SiLU can be fused in. A ``torch.library`` custom op with a FLOP formula, counted like a convolution.

Under ``torch.export`` (and so ``torch.onnx.export(..., dynamo=True)``) the plain grouped ``conv1d`` of
:mod:`.reference` is traced instead of the custom op, so an exported graph holds standard ops only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._library import Grads, Shape, save_tensors, saved_tensors
from .._tiling import time_tiles
from .reference import conv_reference

__all__ = ["TILE_ELEMENTS", "conv_torch", "depthwise_conv1d_flops"]

TILE_ELEMENTS = 1 << 20  # elements of one tile's temporaries (4 MiB in float32)


def _tiles(x: Tensor) -> list[tuple[int, int]]:
    """Time ranges of the tiles of x (batch, length, channels) (one tile off CPU, see :mod:`.._tiling`)."""
    return time_tiles(x.shape[1], x.shape[0] * x.shape[2], TILE_ELEMENTS, x.device)


def _valid(lo: int, hi: int, shift: int, length: int) -> tuple[int, int]:
    """The rows ``t`` of ``[lo, hi)`` whose source row ``t + shift`` lies in ``[0, length)``, as ``[t0, t1)``
    (empty when none do, then ``t0 == t1``)."""
    t0 = min(max(lo, -shift), hi)
    return t0, max(min(hi, length - shift), t0)


def _shifted_sum(src: Tensor, offset: int, length: int, weights: list[Tensor], shifts: list[int], lo: int, hi: int,
                 out: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``out[:, t - lo] = bias + sum_i weights[i] * row(t + shifts[i])`` for the rows ``t`` of ``[lo, hi)``, where
    ``row(j) = src[:, j - offset]`` and a row outside the sequence ``[0, length)`` counts as zero.

    Each product covers only the rows whose source exists (no padded copy of the input: a zero-padded window of a
    long tile is a full fill and copy); the few rows that the first product does not reach start from the bias
    (or zero)."""
    t0, t1 = _valid(lo, hi, shifts[0], length)
    for a, b in ((lo, t0), (t1, hi)):
        if b > a:
            edge = out[:, a - lo:b - lo]
            if bias is not None:
                edge.copy_(bias.expand_as(edge))
            else:
                edge.zero_()
    if t1 > t0:
        first = src[:, t0 + shifts[0] - offset:t1 + shifts[0] - offset]
        if bias is not None:  # the bias rides on the first multiply-add (one pass fewer)
            torch.addcmul(bias, first, weights[0], out=out[:, t0 - lo:t1 - lo])
        else:
            torch.mul(first, weights[0], out=out[:, t0 - lo:t1 - lo])
    for weight, shift in zip(weights[1:], shifts[1:]):
        t0, t1 = _valid(lo, hi, shift, length)
        if t1 > t0:
            out[:, t0 - lo:t1 - lo].addcmul_(src[:, t0 + shift - offset:t1 + shift - offset], weight)
    return out


def _conv_tile(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, lo: int, hi: int, out: Tensor) -> Tensor:
    """The convolution's rows ``[lo, hi)`` (before any activation), written into ``out`` (batch, hi - lo, C);
    ``weight`` is taps-first (k, C) (see :func:`_taps_first`), ``bias`` contiguous. Row t reads x's rows
    ``t - left ... t - left + k - 1`` (zero outside the sequence).

    Every product goes into ``out`` in place: a fresh tensor per product would cost more in allocation (and,
    when the allocator gives memory back, page faults) than the arithmetic itself.
    """
    taps = weight.shape[0]
    return _shifted_sum(x, 0, x.shape[1], list(weight.unbind(0)), [tap - left for tap in range(taps)], lo, hi,
                        out, bias)


def _taps_first(weight: Tensor) -> Tensor:
    """(channels, k) -> (k, channels), contiguous: each tap's per-channel vector must be contiguous, as
    PyTorch's CPU kernels run ~5x slower with a strided (stride k) vector operand."""
    return weight.t().contiguous()


@torch.library.custom_op("mixer_plugins::depthwise_conv1d", mutates_args=())
def _depthwise_conv1d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int,
                         silu: bool) -> Tensor:
    # Tile by tile along time, straight into the output: no temporaries beyond the sequence's two edges.
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    taps = _taps_first(weight)
    bias = None if bias is None else bias.contiguous()
    for lo, hi in _tiles(x):
        tile = _conv_tile(x, taps, bias, left, lo, hi, out[:, lo:hi])
        if silu:
            F.silu(tile, inplace=True)
    return out


@_depthwise_conv1d_op.register_fake
def _fake(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int, silu: bool) -> Tensor:
    return x.new_empty(x.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, bias, left, right, silu = inputs
    # with the activation the backward recomputes the pre-activation from x, so the bias is needed
    save_tensors(ctx, x=x, weight=weight, bias=bias if silu else None)
    ctx.has_bias = bias is not None
    ctx.pads = (left, right)
    ctx.silu = silu


@torch.library.custom_op("mixer_plugins::depthwise_conv1d_backward", mutates_args=())
def _depthwise_conv1d_backward_op(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int,
                                  right: int, with_bias: bool, silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    k = weight.shape[1]
    compute = torch.promote_types(grad.dtype, x.dtype)
    grad_w = torch.zeros(weight.shape[::-1], dtype=compute, device=x.device)   # taps-first (k, C)
    grad_b = torch.zeros(x.shape[-1], dtype=compute, device=x.device) if with_bias else grad.new_empty(0)
    tiles = _tiles(x)
    length = x.shape[1]
    taps = _taps_first(weight)
    bias = None if bias is None else bias.contiguous()
    widest = max(hi - lo for lo, hi in tiles)
    batch, channels = x.shape[0], x.shape[2]
    halo = widest + k - 1  # a tile's rows and the k - 1 rows around it that its input gradient reads
    work = torch.empty(3 if silu else 1, batch * halo * channels, dtype=grad.dtype, device=grad.device)
    ones = torch.ones(batch * widest, dtype=grad.dtype, device=grad.device)
    grad_x = torch.empty(x.shape, dtype=grad.dtype, device=grad.device)
    # One pass, tile by tile. With the activation, the gradient before it (g) is formed for the tile's rows and
    # the k - 1 rows around it (recomputed by neighbouring tiles too: a few rows per tile), in a tile-sized
    # buffer that is still in cache when the input gradient reads it; never a full-size tensor.
    for lo, hi in tiles:
        if silu:
            elo, ehi = max(lo - right, 0), min(hi + left, length)   # rows [lo - right, hi + left) in range
            span = batch * (ehi - elo) * channels
            pre, sig = (work[i, :span].view(batch, ehi - elo, channels) for i in (1, 2))
            _conv_tile(x, taps, bias, left, elo, ehi, pre)
            torch.sigmoid(pre, out=sig)
            pre.mul_(sig)                              # silu(v)
            sig.addcmul_(pre, sig, value=-1.0).add_(pre)   # silu'(v) = sig + silu(v) (1 - sig)
            g_src, g_offset = torch.mul(grad[:, elo:ehi], sig, out=pre), elo   # g's rows [elo, ehi)
        else:
            g_src, g_offset = grad, 0
        g = g_src[:, lo - g_offset:hi - g_offset]
        # the weight and bias gradients (grad_w[tap] = sum_t g_t x_{t + tap - left}, kept taps-first), over
        # the rows whose x exists
        for tap in range(k):
            t0, t1 = _valid(lo, hi, tap - left, length)
            if t1 == t0:
                continue
            n = batch * (t1 - t0)
            # a contiguous buffer: the tap's column sums are then one matrix-vector product
            prod = work[0, :n * channels].view(batch, t1 - t0, channels)
            torch.mul(g[:, t0 - lo:t1 - lo], x[:, t0 + tap - left:t1 + tap - left], out=prod)
            if prod.dtype == compute:
                grad_w[tap].addmv_(prod.view(n, channels).t(), ones[:n])
            else:
                grad_w[tap] += prod.sum(dim=(0, 1))
        if with_bias:
            # rows first, then the batch: g is strided across the batch (a slice of the halo buffer), and
            # PyTorch's CPU reduction over both leading dims at once takes a slow path there (~35x slower at
            # 32 x 32 x 1024)
            grad_b += g.sum(dim=1).sum(dim=0)
        # y_t = sum_tap w_tap x_{t + tap - left}, so the input gradient is the correlation of g with the
        # flipped kernel: row s reads g's rows s - right ... s + left (zero outside the sequence)
        _shifted_sum(g_src, g_offset, length, [taps[k - 1 - tap] for tap in range(k)],
                     [tap - right for tap in range(k)], lo, hi, grad_x[:, lo:hi])
    grad_w = grad_w.t().contiguous().to(weight.dtype)
    return grad_x, grad_w, grad_b.to(weight.dtype) if with_bias else grad_b


@_depthwise_conv1d_backward_op.register_fake
def _backward_fake(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, right: int,
                   with_bias: bool, silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    grad_b = weight.new_empty(x.shape[-1]) if with_bias else grad.new_empty(0)
    return grad.new_empty(x.shape), weight.new_empty(weight.shape), grad_b


def _backward(ctx: Any, grad: Tensor) -> Grads:
    saved = saved_tensors(ctx)
    left, right = ctx.pads
    grad_x, grad_w, grad_b = _depthwise_conv1d_backward_op(grad.contiguous(), saved.x, saved.weight, saved.bias,
                                                           left, right, ctx.has_bias, ctx.silu)
    return grad_x, grad_w, (grad_b if ctx.has_bias else None), None, None, None


_depthwise_conv1d_op.register_autograd(_backward, setup_context=_setup)


def depthwise_conv1d_flops(batch: int, length: int, channels: int, kernel: int) -> int:
    """FLOPs of one depthwise convolution (2 per multiply-add), as FlopCounterMode counts a convolution."""
    return 2 * batch * length * channels * kernel


def register_flops(forward: Any, backward: Any) -> None:
    """Register the FLOP formulas of a convolution op ``(x, weight, ...)`` and of its backward op ``(grad, x,
    weight, ...)``: the input and the weight gradients each cost one forward convolution."""

    @register_flop_formula(forward)
    def _forward(x: Shape, weight: Shape, *args: Any, out_shape: Shape | None = None, **kwargs: Any) -> int:
        return depthwise_conv1d_flops(x[0], x[1], x[2], weight[1])

    @register_flop_formula(backward)
    def _backward(grad: Shape, x: Shape, weight: Shape, *args: Any, out_shape: Shape | None = None,
                  **kwargs: Any) -> int:
        return 2 * depthwise_conv1d_flops(x[0], x[1], x[2], weight[1])


register_flops(torch.ops.mixer_plugins.depthwise_conv1d, torch.ops.mixer_plugins.depthwise_conv1d_backward)


def conv_torch(x: Tensor, weight: Tensor, bias: Tensor | None, left: int, right: int, silu: bool) -> Tensor:
    """The convolution as the tiled custom op (the plain ``conv1d`` of :mod:`.reference` under ``torch.export``)."""
    if torch.compiler.is_exporting():
        return conv_reference(x, weight, bias, left, right, silu)
    return _depthwise_conv1d_op(x, weight, bias, left, right, silu)
