"""``torch`` backend of :func:`..depthwise_conv1d`: shifted multiply-adds, tile by tile, as a custom op.

The block's short convolution (kernel 4-7 over thousands of channels) is a handful of shifted
multiply-adds. Written that way, on the (batch, length, channels) layout the block already has, forward
and backward are a few vectorized passes, with no transposes. They run tile by tile along time (about
1 MiB of temporaries per tile): full-size temporaries would each be a fresh ``mmap``'ed allocation on CPU,
whose page faults cost several times the arithmetic. The block's SiLU can be fused in (``silu=True``).
(PyTorch's CPU depthwise ``conv1d`` backward was ~40x slower than this at L=16384, 1792 channels.)
It is a ``torch.library`` custom op with a FLOP formula, so ``FlopCounterMode`` counts it like a
convolution: 2 * batch * length * channels * kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._dispatch import Backend, register
from .._library import save_tensors, saved_tensors
from .._threads import threads_for
from .._tiling import section_elements, time_tiles

if TYPE_CHECKING:
    from . import ConvArgs

__all__ = ["TILE_ELEMENTS", "depthwise_conv1d_flops"]


TILE_ELEMENTS = 1 << 20  # elements of one tile's temporaries (4 MiB in float32)


def _tiles(x: Tensor) -> list[tuple[int, int]]:
    """Time ranges of the tiles of x (batch, length, channels) (one tile off CPU, see :mod:`.._tiling`)."""
    return time_tiles(x.shape[1], x.shape[0] * x.shape[2], TILE_ELEMENTS, x.device)


def _tile_threads(x: Tensor, tiles: list[tuple[int, int]]):
    """The thread setting of a pass over ``tiles`` (see :mod:`.._threads`): sized by its tiles."""
    return threads_for(section_elements(tiles, x.shape[0] * x.shape[2], TILE_ELEMENTS), x.device)


def _window(x: Tensor, lo: int, hi: int) -> Tensor:
    """Rows ``[lo, hi)`` of x along time, zeros where the range leaves the sequence (a small copy)."""
    length = x.shape[1]
    inside = x[:, max(lo, 0):min(hi, length)]
    before, after = max(0, -lo), max(0, hi - length)
    return F.pad(inside, (0, 0, before, after)) if before or after else inside


def _conv_tile(x: Tensor, weight: Tensor, bias: Optional[Tensor], left: int, lo: int, hi: int, out: Tensor) -> Tensor:
    """The convolution's rows ``[lo, hi)`` (before any activation), written into ``out`` (batch, hi - lo, C);
    ``weight`` is taps-first (k, C) (see :func:`_taps_first`), ``bias`` contiguous.

    Every product goes into ``out`` in place: a fresh tensor per product would cost more in allocation (and,
    when the allocator gives memory back, page faults) than the arithmetic itself.
    """
    taps = weight.shape[0]
    xp = _window(x, lo - left, hi - left + taps - 1)
    if bias is not None:  # the bias rides on the first tap's multiply-add (one pass fewer)
        torch.addcmul(bias, xp[:, 0:hi - lo], weight[0], out=out)
    else:
        torch.mul(xp[:, 0:hi - lo], weight[0], out=out)
    for tap in range(1, taps):
        out.addcmul_(xp[:, tap: tap + hi - lo], weight[tap])
    return out


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
    tiles = _tiles(x)
    with _tile_threads(x, tiles):
        for lo, hi in tiles:
            tile = _conv_tile(x, taps, bias, left, lo, hi, out[:, lo:hi])
            if silu:
                F.silu(tile, inplace=True)
    return out


@_depthwise_conv1d_op.register_fake
def _fake(x, weight, bias, left, right, silu):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
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
    with _tile_threads(x, tiles):
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
            rows = batch * (hi - lo)
            # contiguous tile-sized buffers: each tap's column sums are then one matrix-vector product
            prod = work[0, :rows * channels].view(batch, hi - lo, channels)
            if silu:
                elo, ehi = max(lo - right, 0), min(hi + left, length)   # rows [lo - right, hi + left) in range
                span = batch * (ehi - elo) * channels
                pre, sig = (work[i, :span].view(batch, ehi - elo, channels) for i in (1, 2))
                _conv_tile(x, taps, bias, left, elo, ehi, pre)
                torch.sigmoid(pre, out=sig)
                pre.mul_(sig)                              # silu(v)
                sig.addcmul_(pre, sig, value=-1.0).add_(pre)   # silu'(v) = sig + silu(v) (1 - sig)
                g_ext = torch.mul(grad[:, elo:ehi], sig, out=pre)
                g = g_ext[:, lo - elo:hi - elo]
                # zeros where the window leaves the sequence (a small copy at the two edges only)
                before, after = elo - (lo - right), (hi + left) - ehi
                gp = F.pad(g_ext, (0, 0, before, after)) if before or after else g_ext
            else:
                g = grad[:, lo:hi]
                gp = _window(grad, lo - right, hi + left)
            # the weight and bias gradients (grad_w[tap] = sum_t g_t x_{t + tap - left}, kept taps-first)
            xp = _window(x, lo - left, hi - left + k - 1)
            for tap in range(k):
                torch.mul(g, xp[:, tap: tap + hi - lo], out=prod)
                if prod.dtype == compute:
                    grad_w[tap].addmv_(prod.view(rows, channels).t(), ones[:rows])
                else:
                    grad_w[tap] += prod.sum(dim=(0, 1))
            if with_bias:
                grad_b += g.sum(dim=(0, 1))
            # y_t = sum_tap w_tap x_{t + tap - left}, so the input gradient is the correlation of g with the
            # flipped kernel (its rows [lo - right, hi + left) for rows [lo, hi))
            acc = grad_x[:, lo:hi]
            torch.mul(gp[:, 0:hi - lo], taps[k - 1], out=acc)
            for tap in range(1, k):
                acc.addcmul_(gp[:, tap: tap + hi - lo], taps[k - 1 - tap])
    grad_w = grad_w.t().contiguous().to(weight.dtype)
    return grad_x, grad_w, grad_b.to(weight.dtype) if with_bias else grad_b


@_depthwise_conv1d_backward_op.register_fake
def _backward_fake(grad, x, weight, bias, left, right, with_bias, silu):
    grad_b = weight.new_empty(x.shape[-1]) if with_bias else grad.new_empty(0)
    return grad.new_empty(x.shape), weight.new_empty(weight.shape), grad_b


def _backward(ctx, grad: Tensor):
    saved = saved_tensors(ctx)
    left, right = ctx.pads
    grad_x, grad_w, grad_b = _depthwise_conv1d_backward_op(grad.contiguous(), saved.x, saved.weight, saved.bias,
                                                           left, right, ctx.has_bias, ctx.silu)
    return grad_x, grad_w, (grad_b if ctx.has_bias else None), None, None, None


_depthwise_conv1d_op.register_autograd(_backward, setup_context=_setup)


def depthwise_conv1d_flops(batch: int, length: int, channels: int, kernel: int) -> int:
    """FLOPs of one depthwise convolution (2 per multiply-add), as FlopCounterMode counts a convolution."""
    return 2 * batch * length * channels * kernel


@register_flop_formula(torch.ops.mixer_plugins.depthwise_conv1d)
def _flop_formula(x_shape, w_shape, bias_shape, left, right, silu, *args, out_shape=None, **kwargs) -> int:
    return depthwise_conv1d_flops(x_shape[0], x_shape[1], x_shape[2], w_shape[1])


@register_flop_formula(torch.ops.mixer_plugins.depthwise_conv1d_backward)
def _backward_flop_formula(grad_shape, x_shape, w_shape, bias_shape, left, right, with_bias, silu, *args,
                           out_shape=None, **kwargs) -> int:
    # the input gradient and the weight gradient each cost one forward convolution
    return 2 * depthwise_conv1d_flops(x_shape[0], x_shape[1], x_shape[2], w_shape[1])


def impl(args: ConvArgs) -> Tensor:
    return _depthwise_conv1d_op(args.x, args.weight, args.bias, args.left, args.right, args.silu)


BACKEND = register(Backend(op="conv", name="torch", impl=impl, priority=10))
