"""``torch`` backend of :func:`..toeplitz_mix`: the product by FFT, ``y_i = sum_j c_{i-j} v_j``.

Bidirectional: one real FFT convolution of size >= 2L - 1 (no wrap-around reaches the kept outputs):
O(L log L) instead of O(L^2). Causal: :func:`.causal.causal_toeplitz` (direct tiles and FFTs whose inputs all
precede their outputs, O(L log^2 L)), so that no round-off of a future token reaches a past output; its
backward is the FFT backward of the bidirectional product with the negative taps zero. Each is a
``torch.library`` custom op with a FLOP formula, so ``FlopCounterMode`` counts the FFTs (it counts no FFT by
itself). Its outputs are contiguous, as its fake kernels say: the compiler plans memory from the fake kernels' strides.

Under ``torch.export`` (and so ``torch.onnx.export(..., dynamo=True)``) the materialized matrix of :mod:`.reference` is
traced instead (``O(L^2)``, standard ops only): ONNX's exporter translates neither our custom ops nor complex
tensors, so the FFTs cannot be exported.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._library import Shape, save_tensors, saved_tensors
from .causal import CAUSAL_TILE, causal_toeplitz, toeplitz_causal_flops
from .reference import toeplitz_reference

__all__ = ["toeplitz_causal", "toeplitz_fft", "toeplitz_fft_flops"]


def _fft_size(length: int) -> int:
    n = 2 * length - 1
    return 1 << (n - 1).bit_length()  # a power of two >= 2L - 1


def _toeplitz_fft(taps: Tensor, v: Tensor) -> Tensor:
    """taps (b|1, h, 2L-1), v (b, L, h, p) -> (b, L, h, p)."""
    length = v.shape[1]
    n = _fft_size(length)
    compute = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    c_f = torch.fft.rfft(taps.to(compute), n=n, dim=-1)                         # (b, h, n/2+1)
    v_f = torch.fft.rfft(v.to(compute).permute(0, 2, 3, 1), n=n, dim=-1)        # (b, h, p, n/2+1)
    out = torch.fft.irfft(c_f[:, :, None] * v_f, n=n, dim=-1)                   # linear convolution
    return out[..., length - 1: 2 * length - 1].permute(0, 3, 1, 2).to(v.dtype).contiguous()


@torch.library.custom_op("mixer_plugins::toeplitz_fft", mutates_args=())
def toeplitz_fft(taps: Tensor, v: Tensor) -> Tensor:
    """``y_i = sum_j taps[i - j + L - 1] v_j``: taps (b|1, h, 2L-1), v (b, L, h, p) -> (b, L, h, p)."""
    return _toeplitz_fft(taps, v)


@toeplitz_fft.register_fake
def _toeplitz_fft_fake(taps: Tensor, v: Tensor) -> Tensor:
    return v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    taps, v = inputs
    save_tensors(ctx, taps=taps, v=v)


@torch.library.custom_op("mixer_plugins::toeplitz_fft_backward", mutates_args=())
def toeplitz_fft_backward(grad: Tensor, taps: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of ``y_i = sum_j c_{i-j} v_j``: ``dv_j = sum_i c_{i-j} g_i`` (the product with the mirrored taps)
    and ``dc_d = sum_i g_i v_{i-d}`` (a cross-correlation), both by FFT."""
    length = v.shape[1]
    n = _fft_size(length)
    compute = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    grad_v = _toeplitz_fft(taps.flip(-1), grad)
    g_f = torch.fft.rfft(grad.to(compute).permute(0, 2, 3, 1), n=n, dim=-1)          # (b, h, p, n/2+1)
    v_f = torch.fft.rfft(v.to(compute).permute(0, 2, 3, 1), n=n, dim=-1)
    corr = torch.fft.irfft(g_f * v_f.conj(), n=n, dim=-1).sum(2)                      # (b, h, n): lags mod n
    grad_taps = torch.cat([corr[..., n - (length - 1):], corr[..., :length]], dim=-1)  # lags -(L-1) .. L-1
    if taps.shape[0] == 1 and grad_taps.shape[0] != 1:
        grad_taps = grad_taps.sum(0, keepdim=True)
    return grad_taps.to(taps.dtype).contiguous(), grad_v


@toeplitz_fft_backward.register_fake
def _toeplitz_fft_backward_fake(grad: Tensor, taps: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return taps.new_empty(taps.shape), v.new_empty(v.shape)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
    saved = saved_tensors(ctx)
    return toeplitz_fft_backward(grad.contiguous(), saved.taps, saved.v)


toeplitz_fft.register_autograd(_backward, setup_context=_setup)


def toeplitz_fft_flops(batch: int, length: int, heads: int, head_dim: int, tap_batch: int | None = None) -> int:
    """FFT FLOPs of one Toeplitz product: ``2.5 n log2 n`` per real FFT of size n (forward of the taps and of
    every value channel, inverse of every channel) plus 6 per complex multiply of the spectra."""
    n = _fft_size(length)
    per_fft = int(2.5 * n * math.log2(n))
    tap_batch = batch if tap_batch is None else tap_batch
    channels = batch * heads * head_dim
    return tap_batch * heads * per_fft + 2 * channels * per_fft + 6 * channels * (n // 2 + 1)


@register_flop_formula(torch.ops.mixer_plugins.toeplitz_fft)
def _toeplitz_flop_formula(taps_shape: Shape, v_shape: Shape, *args: Any, out_shape: Shape | None = None,
                           **kwargs: Any) -> int:
    b, length, h, p = v_shape
    return toeplitz_fft_flops(b, length, h, p, tap_batch=taps_shape[0])


@register_flop_formula(torch.ops.mixer_plugins.toeplitz_fft_backward)
def _toeplitz_backward_flop_formula(grad_shape: Shape, taps_shape: Shape, v_shape: Shape, *args: Any,
                                    out_shape: Shape | None = None, **kwargs: Any) -> int:
    # the gradient of a convolution is two convolutions (w.r.t. the taps and the values)
    b, length, h, p = v_shape
    return 2 * toeplitz_fft_flops(b, length, h, p, tap_batch=taps_shape[0])


@torch.library.custom_op("mixer_plugins::toeplitz_causal", mutates_args=())
def toeplitz_causal(taps: Tensor, v: Tensor) -> Tensor:
    """``y_i = sum_{d <= i} taps[d] v_{i-d}``: taps (b|1, h, L) of offsets 0 .. L-1, v (b, L, h, p) -> (b, L, h, p);
    output i sees nothing after position i (see :mod:`.causal`)."""
    return causal_toeplitz(taps, v, tile=CAUSAL_TILE)


@toeplitz_causal.register_fake
def _toeplitz_causal_fake(taps: Tensor, v: Tensor) -> Tensor:
    return v.new_empty(v.shape)


def _causal_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
    saved = saved_tensors(ctx)
    taps, v = saved.taps, saved.v
    length = v.shape[1]
    full = torch.cat([taps.new_zeros(*taps.shape[:2], length - 1), taps], dim=-1)
    grad_full, grad_v = toeplitz_fft_backward(grad.contiguous(), full, v)
    return grad_full[..., length - 1:].contiguous(), grad_v


toeplitz_causal.register_autograd(_causal_backward, setup_context=_setup)


@register_flop_formula(torch.ops.mixer_plugins.toeplitz_causal)
def _toeplitz_causal_flop_formula(taps_shape: Shape, v_shape: Shape, *args: Any, out_shape: Shape | None = None,
                                  **kwargs: Any) -> int:
    b, length, h, p = v_shape
    return toeplitz_causal_flops(b, length, h, p, tap_batch=taps_shape[0])


def toeplitz_torch(taps: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The mix by FFT (causal: by :func:`.causal.causal_toeplitz`); the reference under ``torch.export``."""
    if torch.compiler.is_exporting():
        return toeplitz_reference(taps, v, causal)
    if v.shape[0] == 0:  # an empty batch: nothing to convolve (the FFT rejects empty inputs)
        return v.new_zeros(v.shape)
    if causal:
        return toeplitz_causal(taps[..., v.shape[1] - 1:].contiguous(), v)
    return toeplitz_fft(taps, v)
