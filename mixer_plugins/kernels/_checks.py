"""Argument checks shared by the ops: a failed check is a :class:`~mixer_plugins.errors.MixerInputError`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import MixerInputError

__all__ = ["check", "check_qkv", "check_right_padded_mask"]


def check(cond: bool, message: str | Callable[[], str]) -> None:
    """Raise :class:`MixerInputError` with ``message`` unless ``cond``; a callable message is formed only then (for
    the ops called once a token, where formatting every message would cost more than the op)."""
    if not cond:
        raise MixerInputError(message if isinstance(message, str) else message())


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """The attention ops' common checks: q, k (batch, length, heads, width) of one shape, v sharing (batch, length,
    heads), one floating dtype, one device. ``TypeError``/``ValueError`` name what is wrong."""
    if not all(isinstance(t, Tensor) for t in (q, k, v)):
        raise TypeError("q, k and v must be tensors")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, length, heads, width); got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must share (batch, length, heads) {tuple(q.shape[:3])} with q, got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_right_padded_mask(mask: Tensor | None, q: Tensor) -> None:
    """``mask`` (if given): bool (batch, length) on q's device, True on the real tokens, then False on the pads.
    The padding order is data-dependent, so it is checked in eager only (under ``torch.compile`` / ``torch.export``
    it would break the graph), and not on meta tensors (they have no values)."""
    if mask is None:
        return
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a bool tensor (batch, length), True on real tokens")
    if mask.shape != q.shape[:2]:
        raise ValueError(f"mask must have shape (batch, length) = {tuple(q.shape[:2])}, got {tuple(mask.shape)}")
    if mask.device != q.device:
        raise ValueError(f"mask is on {mask.device} but q on {q.device}")
    if (not torch.compiler.is_compiling() and mask.device.type != "meta" and mask.shape[1] > 1
            and (mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("mask must be right-padded: True on the real tokens, then False on the pads")
