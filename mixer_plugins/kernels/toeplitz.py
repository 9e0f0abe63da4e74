"""Toeplitz (long convolution) mixing by FFT: ``y_i = sum_j c_{i-j} v_j``.

``taps`` holds the 2L-1 diagonals of the Toeplitz matrix, offset ``d = i - j`` at index ``d + L - 1``.
The product is one real FFT convolution of size >= 2L - 1 (no wrap-around reaches the kept outputs):
O(L log L) instead of O(L^2). It is a ``torch.library`` custom op with a FLOP formula, so
``FlopCounterMode`` counts the FFTs (it counts no FFT by itself).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..errors import MixerInputError
from .dispatch import register_backend, resolve_backend

__all__ = ["toeplitz_mix", "toeplitz_matrix", "toeplitz_fft_flops"]


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
    return out[..., length - 1: 2 * length - 1].permute(0, 3, 1, 2).to(v.dtype)


@torch.library.custom_op("mixer_plugins::toeplitz_fft", mutates_args=())
def toeplitz_fft(taps: Tensor, v: Tensor) -> Tensor:
    return _toeplitz_fft(taps, v)


@toeplitz_fft.register_fake
def _toeplitz_fft_fake(taps, v):
    return v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


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
    return grad_taps.to(taps.dtype), grad_v


@toeplitz_fft_backward.register_fake
def _toeplitz_fft_backward_fake(grad, taps, v):
    return taps.new_empty(taps.shape), v.new_empty(v.shape)


def _backward(ctx, grad):
    taps, v = ctx.saved_tensors
    return toeplitz_fft_backward(grad.contiguous(), taps, v)


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
def _toeplitz_flop_formula(taps_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    b, length, h, p = v_shape
    return toeplitz_fft_flops(b, length, h, p, tap_batch=taps_shape[0])


@register_flop_formula(torch.ops.mixer_plugins.toeplitz_fft_backward)
def _toeplitz_backward_flop_formula(grad_shape, taps_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    # the gradient of a convolution is two convolutions (w.r.t. the taps and the values)
    b, length, h, p = v_shape
    return 2 * toeplitz_fft_flops(b, length, h, p, tap_batch=taps_shape[0])


def toeplitz_matrix(taps: Tensor, length: int) -> Tensor:
    """(b, h, 2L-1) diagonals -> the (b, h, L, L) Toeplitz matrix ``M_ij = taps[i - j + L - 1]``."""
    idx = torch.arange(length, device=taps.device)
    offsets = idx[:, None] - idx[None, :] + length - 1
    return taps[..., offsets]


def toeplitz_mix(taps: Tensor, v: Tensor, *, backend: str | None = None) -> Tensor:
    """``y_i = sum_j taps[i - j + L - 1] v_j`` per head; taps (b or 1, h, 2L-1), v (b, L, h, p)."""
    if v.dim() != 4:
        raise MixerInputError(f"toeplitz_mix: v must be (batch, length, heads, head_dim), got {tuple(v.shape)}")
    b, length, h, _ = v.shape
    if taps.dim() != 3 or taps.shape[1:] != (h, 2 * length - 1) or taps.shape[0] not in (1, b):
        raise MixerInputError(
            f"toeplitz_mix: taps must be (batch or 1, heads, 2*length-1) = (*, {h}, {2 * length - 1}), "
            f"got {tuple(taps.shape)}"
        )
    return resolve_backend("toeplitz", backend, v.device)(taps, v)


@register_backend("toeplitz", "torch")
def _toeplitz_torch(taps: Tensor, v: Tensor) -> Tensor:
    return toeplitz_fft(taps, v)


@register_backend("toeplitz", "reference")
def _toeplitz_reference(taps: Tensor, v: Tensor) -> Tensor:
    matrix = toeplitz_matrix(taps, v.shape[1]).to(v.dtype)
    return torch.einsum("bhij,bjhp->bihp", matrix.expand(v.shape[0], -1, -1, -1), v)
