"""``mamba_ssm`` backend of :func:`..ssd`: mamba-ssm's fused Triton SSD kernel (``mamba_chunk_scan_combined``),
on CUDA tensors. Loaded on first use by :mod:`.._mamba_loader`, which also works where mamba-ssm's CUDA extensions
are missing (a wheel built with ``MAMBA_SKIP_CUDA_BUILD=TRUE``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import mamba_ssm_unavailable

if TYPE_CHECKING:
    from . import SSDArgs


def impl(args: SSDArgs) -> Tensor | tuple[Tensor, Tensor]:
    from .._mamba_loader import load

    return load().mamba_chunk_scan_combined(
        args.x, args.dt, args.A, args.B, args.C, args.chunk_size, D=args.D, z=args.z, dt_bias=args.dt_bias,
        initial_states=args.initial_states, seq_idx=args.seq_idx, dt_softplus=args.dt_softplus,
        dt_limit=args.dt_limit, return_final_states=args.return_final_states,
    )


BACKEND = register(Backend(op="ssd", name="mamba_ssm", impl=impl, priority=30, check=mamba_ssm_unavailable))
