"""What our Triton backends need, as a ``check(device, args)`` function for :class:`._dispatch.Backend`.

It returns why the backend cannot run (``None`` when it can), from the device, the input dtype and whether Triton is
installed (looked up once, without importing it): importing the kernels never imports Triton.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

__all__ = ["TRITON_INSTALLED", "triton_unavailable"]

#: Whether Triton is installed (found without importing it).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_unavailable(device: torch.device, args: Any = None) -> str | None:
    """Our Triton kernels: Triton installed, CUDA tensors (CPU ones only under ``TRITON_INTERPRET=1``), and not
    float64.

    The float64 policy is the same for every Triton backend: they compute in float32 at most, so they refuse float64
    inputs (``args.dtype``, the dtype of the call's main input) and the dispatcher runs the ``torch`` backend, which
    computes in float64. Asked for by name, a Triton backend raises :class:`BackendUnavailableError` for float64.
    """
    if not TRITON_INSTALLED:
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU testing)"
    if args is not None and getattr(args, "dtype", None) == torch.float64:
        return "the Triton kernels compute in float32 at most; float64 inputs run on the torch backend"
    return None
