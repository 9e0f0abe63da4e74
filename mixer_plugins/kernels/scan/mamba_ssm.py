"""``mamba_ssm`` backend of the scan: mamba-ssm's fused Triton SSD (``mamba_chunk_scan_combined``), on CUDA tensors.

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

from .._dispatch import Backend, register
from .inputs import Direction, ScanArgs

__all__ = ["MODULE", "impl", "load"]

#: The module that holds mamba-ssm's fused SSD.
MODULE = "mamba_ssm.ops.triton.ssd_combined"

_loaded: dict[str, Any] = {}


def load() -> Callable[..., Any]:
    """mamba-ssm's ``mamba_chunk_scan_combined`` (imported on the first call; an ``ImportError`` says why not)."""
    if "scan" not in _loaded:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        _loaded["scan"] = mamba_chunk_scan_combined
    return _loaded["scan"]


def _causal_ssd(args: ScanArgs) -> bool:
    """A scan mamba-ssm runs in one call: the forward direction alone, unshifted, no diagonal."""
    return args.forward is not None and args.backward is None and not args.shift and args.diag is None


def _unavailable(device: torch.device, args: Any = None) -> str | None:
    if device.type != "cuda":
        return f"mamba-ssm's kernels need CUDA tensors (got {device.type})"
    if args is not None and not _causal_ssd(args) and (args.initial_state is not None or args.return_final_state):
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


def _direction(args: ScanArgs, d: Direction, *, reverse: bool) -> Tensor:
    """One direction at original positions, shifted when ``args.shift``."""
    scan = load()
    kw = dict(dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_limit=args.dt_limit)
    seq_idx = args.seq_idx
    if not reverse:
        y = scan(args.x, d.dt, d.A, d.B, d.C, args.chunk_size, seq_idx=seq_idx, **kw)
    else:
        flipped = None if seq_idx is None else seq_idx.flip(1).contiguous()
        y = scan(args.x.flip(1), d.dt.flip(1), d.A, d.B.flip(1), d.C.flip(1), args.chunk_size, seq_idx=flipped,
                 **kw).flip(1)
    if not args.shift:
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


def impl(args: ScanArgs) -> Tensor | tuple[Tensor, Tensor]:
    args = args.with_rates()
    d = args.forward
    if _causal_ssd(args):
        assert d is not None
        return load()(args.x, d.dt, d.A, d.B, d.C, args.chunk_size, D=args.D, z=args.z, dt_bias=args.dt_bias,
                      initial_states=args.initial_state, seq_idx=args.seq_idx, dt_softplus=args.dt_softplus,
                      dt_limit=args.dt_limit, return_final_states=args.return_final_state)
    y = None
    for direction, reverse in ((args.forward, False), (args.backward, True)):
        if direction is not None:
            part = _direction(args, direction, reverse=reverse)
            y = part if y is None else y + part
    assert y is not None
    diag = args.skip_as_diag(args.diag)
    if diag is not None:
        y = y + diag[..., None].to(y.dtype) * args.x
    return args.finish(y, None)


BACKEND = register(Backend(op="scan", name="mamba_ssm", impl=impl, priority=30, check=_unavailable,
                           automatic_devices=("cuda",)))
