"""What the third-party backends need, as ``check(device, args)`` functions for :class:`._dispatch.Backend`.

Each returns why the backend cannot run (``None`` when it can). The packages are probed lazily and the
result of an import is cached: importing the kernels never imports mamba-ssm or Triton.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

__all__ = ["mamba_ssm_unavailable", "triton_unavailable"]


def _mamba_ssm_load_error() -> str | None:
    """Why mamba-ssm's Triton SSD cannot be loaded (``None``: it is). Loads it on the first call; the loader
    remembers the module, or why it failed."""
    from . import _mamba_loader

    try:
        _mamba_loader.load()
    except ImportError as err:
        return str(err)
    return None


def mamba_ssm_unavailable(device: torch.device, args: Any = None) -> str | None:
    """mamba-ssm's Triton SSD kernels: the package installed (its CUDA extensions are not needed: see
    :mod:`._mamba_loader`), Triton and einops installed, and CUDA tensors.

    CPU tensors are refused even under ``TRITON_INTERPRET=1``: mamba-ssm's host code asks ``torch.cuda`` for the
    current device and the SM count, which fails without a CUDA driver (the CPU tests shim those calls).
    Nothing is imported unless the package is installed and the tensors are on CUDA.
    """
    from . import _mamba_loader

    reason = _mamba_loader.unavailable_reason()
    if reason is not None:
        return reason
    if device.type != "cuda":
        return (f"mamba-ssm's kernels need CUDA tensors (got {device.type}); not even TRITON_INTERPRET=1 runs them "
                "on CPU tensors, as mamba-ssm's host code queries torch.cuda")
    if not torch.cuda.is_available():
        return "mamba-ssm's kernels need a CUDA device, and torch finds none"
    return _mamba_ssm_load_error()


def triton_unavailable(device: torch.device, args: Any = None) -> str | None:
    """Our Triton kernels: Triton installed, CUDA tensors (CPU ones only under ``TRITON_INTERPRET=1``), and not
    float64.

    The float64 policy is the same for every Triton backend: they compute in float32 at most, so they refuse float64
    inputs (``args.dtype``, the dtype of the call's main input) and the dispatcher runs the ``torch`` backend, which
    computes in float64. Asked for by name, a Triton backend raises :class:`BackendUnavailableError` for float64.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU testing)"
    if args is not None and getattr(args, "dtype", None) == torch.float64:
        return "the Triton kernels compute in float32 at most; float64 inputs run on the torch backend"
    return None
