"""Toeplitz (long convolution) mixing: ``y_i = sum_j c_{i-j} v_j`` per head.

``taps`` holds the 2L-1 diagonals of the Toeplitz matrix, offset ``d = i - j`` at index ``d + L - 1``.
Forms: ``reference`` (the materialized matrix), ``torch`` (the default: one real FFT convolution, O(L log L);
causal: direct tiles plus FFTs whose inputs all precede their outputs, O(L log^2 L), so a past output never
sees a future token, not even through round-off).
:data:`TOEPLITZ` names them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...errors import MixerInputError
from .._dispatch import Op
from .causal import toeplitz_causal_flops
from .reference import toeplitz_matrix, toeplitz_reference
from .torch import toeplitz_fft_flops, toeplitz_torch

__all__ = ["TOEPLITZ", "toeplitz_causal_flops", "toeplitz_fft_flops", "toeplitz_matrix", "toeplitz_mix"]


def _runs_anywhere(backend: str, device: Any, **call: Any) -> None:
    return None


#: The mix's forms: both run on any device and dtype; ``torch`` is the automatic choice everywhere.
TOEPLITZ = Op("toeplitz", backends=("reference", "torch"), automatic={}, why_not=_runs_anywhere)


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
    if TOEPLITZ.choose(backend, v.device) == "reference":
        return toeplitz_reference(taps, v, causal)
    return toeplitz_torch(taps, v, causal)
