"""``mamba_ssm`` backend of :func:`..ssd`: mamba-ssm's fused Triton kernels (CUDA tensors; imported lazily)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import mamba_ssm_unavailable

if TYPE_CHECKING:
    from . import SSDArgs


def impl(args: SSDArgs) -> Tensor | tuple[Tensor, Tensor]:  # pragma: no cover - needs CUDA and mamba-ssm
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined(
        args.x, args.dt, args.A, args.B, args.C, args.chunk_size, D=args.D, z=args.z, dt_bias=args.dt_bias,
        initial_states=args.initial_states, seq_idx=args.seq_idx, dt_softplus=args.dt_softplus,
        dt_limit=args.dt_limit, return_final_states=args.return_final_states,
    )


BACKEND = register(Backend(op="ssd", name="mamba_ssm", impl=impl, priority=30, check=mamba_ssm_unavailable))
