"""``triton`` backend of :func:`..ssd`: our fused scan (:mod:`.._triton.scan`) with the backward direction off.
Loaded on first use; chosen first on CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable

if TYPE_CHECKING:
    from . import SSDArgs


def impl(args: SSDArgs) -> Tensor | tuple[Tensor, Tensor]:
    from .._triton.scan import ssd_triton

    return ssd_triton(
        args.x, args.dt, args.A, args.B, args.C, args.chunk_size, D=args.D, z=args.z, dt_bias=args.dt_bias,
        initial_states=args.initial_states, seq_idx=args.seq_idx, dt_softplus=args.dt_softplus,
        dt_limit=args.dt_limit, return_final_states=args.return_final_states)


BACKEND = register(Backend(op="ssd", name="triton", impl=impl, priority=40, check=triton_unavailable,
                           automatic_devices=("cuda",)))
