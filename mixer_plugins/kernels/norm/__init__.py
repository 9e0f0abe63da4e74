"""Gated RMSNorm over the last dimension (the blocks' output norm).

``norm_before_gate=True``:  ``out = w * y / rms(y) * silu(z)``
``norm_before_gate=False``: ``out = w * u / rms(u)`` with ``u = y * silu(z)`` (Mamba-2's order)

Forms: ``reference`` (the formula as plain ops), ``torch`` (tile by tile with a hand-written backward; the formula
under ``torch.compile``), ``native`` (our C++ kernel; the CPU default), ``triton`` (one fused kernel each way; the
CUDA default). :data:`NORM` names them and the automatic order.
"""

from __future__ import annotations

import torch as _torch  # plain ``torch`` would be shadowed by this package's ``torch`` submodule
from torch import Tensor, promote_types

from .._checks import check
from .._dispatch import Op
from .._native_check import native_unavailable
from .._requirements import triton_unavailable
from .native import norm_native
from .reference import gated_rmsnorm_reference
from .torch import norm_torch

__all__ = ["NORM", "gated_rmsnorm", "gated_rmsnorm_reference"]


def _why_not(backend: str, device: _torch.device, *, y: Tensor | None = None, z: Tensor | None = None,
             weight: Tensor | None = None) -> str | None:
    """Why ``backend`` cannot normalize ``y`` gated by ``z`` on ``device`` (``None`` when it can)."""
    if backend == "native":
        if y is None or z is None or weight is None:
            return native_unavailable(device)
        if y.numel() == 0:
            return "empty input"
        if y.stride(-1) != 1 or z.stride(-1) != 1:
            return "the native kernel reads contiguous rows"
        return native_unavailable(device, [y, z, weight])
    if backend == "triton":
        reason = triton_unavailable(device, None if y is None or z is None else promote_types(y.dtype, z.dtype))
        if reason is not None or y is None:
            return reason
        from .triton_kernels import MAX_WIDTH

        if y.shape[-1] > MAX_WIDTH:
            return (f"rows of width {y.shape[-1]} are over the kernels' limit {MAX_WIDTH}; the torch backend "
                    "takes them")
    return None


#: The norm's forms, and the automatic order per device type (the first that can run the call runs it).
NORM = Op("norm", backends=("reference", "torch", "native", "triton"),
          automatic={"cuda": ("triton", "torch"), "cpu": ("native", "torch")}, why_not=_why_not)


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
    return norm_by_name(NORM.choose(backend, y.device, y=y, z=z, weight=weight), y, z, weight, eps,
                        norm_before_gate)


def norm_by_name(name: str, y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
    """The norm on the backend ``name`` that :data:`NORM` chose."""
    if name == "native":
        return norm_native(y, z, weight, eps, norm_before_gate)
    if name == "triton":
        from .triton_kernels import gated_rmsnorm_triton

        return gated_rmsnorm_triton(y, z, weight, eps, norm_before_gate)
    if name == "reference":
        return gated_rmsnorm_reference(y, z, weight, eps, norm_before_gate)
    return norm_torch(y, z, weight, eps, norm_before_gate)
