"""What our Triton backends need: the reason a Triton form cannot run a call, for the ops' ``why_not``.

It returns why the backend cannot run (``None`` when it can), from the device, the input dtype and whether Triton is
installed (looked up once, without importing it): importing the kernels never imports Triton.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["MAX_ROW_SPAN", "TRITON_INSTALLED", "triton_attention_unavailable", "triton_unavailable"]

#: The attention kernels index within a batch's slice with 32-bit offsets: :func:`._dispatch.row_span` stays below
#: this.
MAX_ROW_SPAN = 2**31

#: Whether Triton is installed (found without importing it).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_unavailable(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """Our Triton kernels: Triton installed, CUDA tensors (CPU ones only under ``TRITON_INTERPRET=1``), and not
    float64.

    The float64 policy is the same for every Triton backend: they compute in float32 at most, so they refuse float64
    inputs (``dtype``, the dtype of the call's main input) and the dispatcher runs the ``torch`` backend, which
    computes in float64. Asked for by name, a Triton backend raises :class:`BackendUnavailableError` for float64.
    """
    if not TRITON_INSTALLED:
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU testing)"
    if dtype == torch.float64:
        return "the Triton kernels compute in float32 at most; float64 inputs run on the torch backend"
    return None


def triton_attention_unavailable(device: torch.device, dtype: torch.dtype | None = None, span: int = 0) -> str | None:
    """:func:`triton_unavailable`, and the attention kernels' 32-bit offsets: a call whose ``span`` (the
    largest offset within a batch's slice, :func:`._dispatch.row_span`) reaches :data:`MAX_ROW_SPAN` runs on the
    ``torch`` backend."""
    reason = triton_unavailable(device, dtype)
    if reason is None and span >= MAX_ROW_SPAN:
        return (f"the Triton attention kernels index a batch's slice in 32 bits (its span is {span} "
                f">= 2^31 elements); such a call runs on the torch backend")
    return reason
