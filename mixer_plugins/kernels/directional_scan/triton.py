"""``triton`` backend of :func:`..directional_scan`: our fused scan (:mod:`.._triton.scan`) with one direction
off. Loaded on first use; chosen first on CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable

if TYPE_CHECKING:
    from . import DirectionalScanArgs


def impl(args: DirectionalScanArgs) -> Tensor:
    from .._triton.scan import directional_scan_triton

    return directional_scan_triton(
        args.x, args.dt, args.A, args.B, args.C, reverse=args.reverse, shift=args.shift, chunk_size=args.chunk_size,
        dt_bias=args.dt_bias, dt_softplus=args.dt_softplus, dt_limit=args.dt_limit, seq_idx=args.seq_idx)


BACKEND = register(Backend(op="directional_scan", name="triton", impl=impl, priority=40, check=triton_unavailable,
                           automatic_devices=("cuda",)))
