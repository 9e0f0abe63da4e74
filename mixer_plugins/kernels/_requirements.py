"""What the third-party backends need, as ``check(device, args)`` functions for :class:`._dispatch.Backend`.

Each returns why the backend cannot run (``None`` when it can). The packages are probed lazily and the
result of an import is cached: importing the kernels never imports mamba-ssm or Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

__all__ = ["mamba_ssm_unavailable", "triton_unavailable"]


@functools.cache
def _mamba_ssm_import_error() -> str | None:
    if importlib.util.find_spec("mamba_ssm") is None:
        return "mamba-ssm is not installed (pip extra 'cuda')"
    try:  # its package __init__ imports the CUDA extension; import lazily and report why it failed
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return f"mamba-ssm failed to import: {type(err).__name__}: {err}"
    return None


def mamba_ssm_unavailable(device: torch.device, args: Any = None) -> str | None:
    """mamba-ssm's kernels: the package installed and importable, and CUDA tensors."""
    if importlib.util.find_spec("mamba_ssm") is None:
        return "mamba-ssm is not installed (pip extra 'cuda')"
    if device.type != "cuda":
        return f"mamba-ssm needs CUDA tensors (got {device.type})"
    return _mamba_ssm_import_error()


def triton_unavailable(device: torch.device, args: Any = None) -> str | None:
    """Our Triton kernels: Triton installed, and CUDA tensors (CPU ones only under ``TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU testing)"
