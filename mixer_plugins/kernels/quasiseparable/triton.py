"""``triton`` backend of :func:`..quasiseparable`: our fused scan (:mod:`.._triton.scan`), both directions in one
chunked pass, forward and backward in Triton. Loaded on first use; chosen first on CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable

if TYPE_CHECKING:
    from . import QuasiseparableArgs


def impl(args: QuasiseparableArgs) -> Tensor:
    from .._triton.scan import quasiseparable_triton

    return quasiseparable_triton(
        args.x, args.dt, args.A, args.B, args.C, dt_bwd=args.dt_bwd, A_bwd=args.A_bwd, B_bwd=args.B_bwd,
        C_bwd=args.C_bwd, diag=args.diag, shift=args.shift, chunk_size=args.chunk_size, dt_bias=args.dt_bias,
        dt_softplus=args.dt_softplus, dt_limit=args.dt_limit, seq_idx=args.seq_idx)


BACKEND = register(Backend(op="quasiseparable", name="triton", impl=impl, priority=40, check=triton_unavailable,
                           automatic_devices=("cuda",)))
