"""Gated RMSNorm over the last dimension (the blocks' output norm).

``norm_before_gate=True``:  ``out = w * y / rms(y) * silu(z)``
``norm_before_gate=False``: ``out = w * u / rms(u)`` with ``u = y * silu(z)`` (Mamba-2's order)

Backends: ``reference`` (the formula as plain ops), ``torch`` (tile by tile with a hand-written backward; the
formula under ``torch.compile``; the default off CUDA), ``triton`` (one fused kernel each way; the default on CUDA).
Each is a module of this folder that registers itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, promote_types
from torch import dtype as DType

from .._checks import check
from .._dispatch import discover_backends, resolve_backend
from .reference import gated_rmsnorm_reference

__all__ = ["NormArgs", "gated_rmsnorm", "gated_rmsnorm_reference"]


@dataclass(frozen=True)
class NormArgs:
    """The arguments of one :func:`gated_rmsnorm` call: y and z (same shape), weight (width,)."""

    y: Tensor
    z: Tensor
    weight: Tensor
    eps: float = 1e-5
    norm_before_gate: bool = True

    @property
    def dtype(self) -> DType:
        """The dtype the call computes in (y's and z's promoted): what a backend's dtype policy reads."""
        return promote_types(self.y.dtype, self.z.dtype)


def gated_rmsnorm(y: Tensor, z: Tensor, weight: Tensor, eps: float = 1e-5, norm_before_gate: bool = True, *,
                  backend: str | None = None) -> Tensor:
    """Gated RMSNorm over the last dimension of ``y`` and ``z`` (same shape), with per-channel ``weight``.

    Half-precision inputs are normalized in float32 and returned in their dtype. Eager mode runs the tiled
    op with its hand-written backward; under ``torch.compile`` the plain formula is traced and fused.
    ``backend``: see :mod:`mixer_plugins.kernels`.
    """
    check(y.shape == z.shape,
          lambda: f"gated_rmsnorm: y and z must have the same shape, got {tuple(y.shape)} and {tuple(z.shape)}")
    check(weight.shape == (y.shape[-1],),
          lambda: f"gated_rmsnorm: weight must be ({y.shape[-1]},), got {tuple(weight.shape)}")
    args = NormArgs(y=y, z=z, weight=weight, eps=eps, norm_before_gate=norm_before_gate)
    return resolve_backend("norm", backend, y.device, args)(args)


discover_backends("norm", __name__)
