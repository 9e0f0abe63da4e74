"""The availability check the ``native`` backends share (see :class:`._dispatch.Backend`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _native

__all__ = ["native_unavailable", "require_native"]


def native_unavailable(device: torch.device, tensors: Sequence[Tensor] = ()) -> str | None:
    """Why our C++ CPU kernels cannot run on ``tensors`` (``None`` when they can): CPU, eager (compiled and exported
    graphs trace the ``torch`` backend), every tensor of one dtype, float32 or float64, and the library installed
    and loaded (it is built at install, never here)."""
    if device.type != "cpu":
        return f"the native kernels run on CPU tensors (got {device.type})"
    if torch.compiler.is_compiling():
        return "the native kernels run eagerly; compiled and exported graphs trace the torch backend"
    if tensors:
        dtype = tensors[0].dtype
        if dtype not in (torch.float32, torch.float64):
            return f"the native kernels compute in float32 or float64 (got {dtype})"
        for t in tensors:
            if t.dtype != dtype:
                return "the native kernels need every input in one dtype"
    if not _native.load():
        return f"the native kernels are unavailable: {_native.unavailable_reason()}"
    return None


def require_native() -> None:
    """Load the native kernels before an op of theirs runs; a clear error where they cannot be."""
    if not _native.load():
        raise RuntimeError(f"the native kernels are unavailable: {_native.unavailable_reason()}")
