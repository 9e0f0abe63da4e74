"""``mamba_ssm`` form of the scan: mamba-ssm's fused Triton SSD (``mamba_chunk_scan_combined``), on CUDA tensors.

A causal SSD call goes to mamba-ssm as it is (skip, gate, initial and final states included). Other scans run each
direction through it: the backward one on the time-reversed sequence, then the one-token shift (cut at segment
starts), then the diagonal, the way the released Hydra code runs it. mamba-ssm only compares ``seq_idx`` labels for
equality, so the flipped labels still mark the segments.

mamba-ssm is imported the ordinary way, on first use: where ``import mamba_ssm.ops.triton.ssd_combined`` fails (the
package missing, or its CUDA extensions, which its ``__init__`` imports), the backend is unavailable and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .inputs import Direction

__all__ = ["MODULE", "load", "mamba_ssm_scan", "mamba_ssm_unavailable"]

#: The module that holds mamba-ssm's fused SSD.
MODULE = "mamba_ssm.ops.triton.ssd_combined"

_loaded: dict[str, Any] = {}


def load() -> Callable[..., Any]:
    """mamba-ssm's ``mamba_chunk_scan_combined`` (imported on the first call; an ``ImportError`` says why not)."""
    if "scan" not in _loaded:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        _loaded["scan"] = mamba_chunk_scan_combined
    return _loaded["scan"]


def mamba_ssm_unavailable(device: torch.device, *, carries_state: bool = False) -> str | None:
    """Why mamba-ssm cannot run a scan on ``device`` (``None`` when it can); ``carries_state``: a scan other than a
    causal, unshifted SSD that takes an initial state or returns its final one."""
    if device.type != "cuda":
        return f"mamba-ssm's kernels need CUDA tensors (got {device.type})"
    if carries_state:
        return "mamba-ssm carries states only for a causal, unshifted scan"
    if "scan" in _loaded:
        return None
    if torch.compiler.is_compiling():
        return "mamba-ssm is imported on an eager call; call it once before compiling"
    try:
        load()
    except ImportError as err:  # the package, Triton, einops or mamba-ssm's CUDA extensions missing
        return f"mamba-ssm's Triton SSD cannot be imported ({type(err).__name__}: {err})"
    return None


def _direction(x: Tensor, d: Direction, *, reverse: bool, shift: bool, seq_idx: Tensor | None, chunk_size: int,
               **dt_options: Any) -> Tensor:
    """One direction at original positions, shifted when ``shift``."""
    scan = load()
    if not reverse:
        y = scan(x, d.dt, d.A, d.B, d.C, chunk_size, seq_idx=seq_idx, **dt_options)
    else:
        flipped = None if seq_idx is None else seq_idx.flip(1).contiguous()
        y = scan(x.flip(1), d.dt.flip(1), d.A, d.B.flip(1), d.C.flip(1), chunk_size, seq_idx=flipped,
                 **dt_options).flip(1)
    if not shift:
        return y
    # token i reads the output at i - 1 (forward) or i + 1 (reverse), never across a segment start
    if reverse:
        y = F.pad(y[:, 1:], (0, 0, 0, 0, 0, 1))
        same = None if seq_idx is None else F.pad(seq_idx[:, 1:] == seq_idx[:, :-1], (0, 1))
    else:
        y = F.pad(y[:, :-1], (0, 0, 0, 0, 1, 0))
        same = None if seq_idx is None else F.pad(seq_idx[:, 1:] == seq_idx[:, :-1], (1, 0))
    if same is not None:
        y = torch.where(same[:, :, None, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y


def mamba_ssm_scan(x: Tensor, forward: Direction | None, backward: Direction | None = None, *,
                   diag: Tensor | None = None, seq_idx: Tensor | None = None, shift: bool = False,
                   chunk_size: int = 64, **dt_options: Any) -> Tensor:
    """A scan other than the causal SSD through mamba-ssm, direction by direction (``A`` the rates; ``dt_options``:
    ``dt_bias``, ``dt_softplus``, ``dt_limit`` as mamba-ssm takes them), plus ``diag``; y in mamba-ssm's dtype."""
    y = None
    for direction, reverse in ((forward, False), (backward, True)):
        if direction is not None:
            part = _direction(x, direction, reverse=reverse, shift=shift, seq_idx=seq_idx, chunk_size=chunk_size,
                              **dt_options)
            y = part if y is None else y + part
    assert y is not None, "a scan needs at least one direction"
    if diag is not None:
        y = y + diag[..., None].to(y.dtype) * x
    return y
