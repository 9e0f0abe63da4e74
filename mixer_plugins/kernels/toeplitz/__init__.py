"""Toeplitz (long convolution) mixing: ``y_i = sum_j c_{i-j} v_j`` per head.

``taps`` holds the 2L-1 diagonals of the Toeplitz matrix, offset ``d = i - j`` at index ``d + L - 1``.
Backends: ``reference`` (the materialized matrix), ``torch`` (the default: one real FFT convolution, O(L log L);
causal: direct tiles plus FFTs whose inputs all precede their outputs, O(L log^2 L), so a past output never
sees a future token, not even through round-off). Each is a module of this folder that registers itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...errors import MixerInputError
from .._dispatch import discover_backends, resolve_backend
from .causal import toeplitz_causal_flops
from .reference import toeplitz_matrix
from .torch import toeplitz_fft_flops

__all__ = ["ToeplitzArgs", "toeplitz_causal_flops", "toeplitz_fft_flops", "toeplitz_matrix", "toeplitz_mix"]


@dataclass(frozen=True)
class ToeplitzArgs:
    """The arguments of one :func:`toeplitz_mix` call: taps (b or 1, h, 2L-1), v (b, L, h, p), causal."""

    taps: Tensor
    v: Tensor
    causal: bool = False


def toeplitz_mix(taps: Tensor, v: Tensor, *, causal: bool = False, backend: str | None = None) -> Tensor:
    """``y_i = sum_j taps[i - j + L - 1] v_j`` per head; taps (b or 1, h, 2L-1), v (b, L, h, p).

    ``causal=True``: only ``j <= i`` (the negative offsets ``taps[:L-1]`` are ignored, never read into an
    output), and output i depends on nothing after position i, round-off included, so a huge future token
    leaves the past unchanged. Batch 0 gives an empty output. ``backend``: see :mod:`mixer_plugins.kernels`."""
    if v.dim() != 4:
        raise MixerInputError(f"toeplitz_mix: v must be (batch, length, heads, head_dim), got {tuple(v.shape)}")
    b, length, h, _ = v.shape
    if taps.dim() != 3 or taps.shape[1:] != (h, 2 * length - 1) or taps.shape[0] not in (1, b):
        raise MixerInputError(
            f"toeplitz_mix: taps must be (batch or 1, heads, 2*length-1) = (*, {h}, {2 * length - 1}), "
            f"got {tuple(taps.shape)}"
        )
    args = ToeplitzArgs(taps=taps, v=v, causal=causal)
    return resolve_backend("toeplitz", backend, v.device, args)(args)


discover_backends("toeplitz", __name__)
