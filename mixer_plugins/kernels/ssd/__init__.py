"""Causal SSD (Mamba-2) with the argument conventions of mamba_ssm's ``mamba_chunk_scan_combined``.

Backends: ``reference`` (materialized, float64-capable), ``torch`` (chunked, O(L) memory; the CPU default),
``mamba_ssm`` (its fused Triton kernels, CUDA). Each is a module of this folder that registers itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from .._checks import check
from .._dispatch import discover_backends, resolve_backend
from .._scan import Direction, ScanInputs, check_generators, check_seq_idx, prepare_dt, upcast

__all__ = ["SSDArgs", "ssd"]


@dataclass(frozen=True)
class SSDArgs:
    """The arguments of one :func:`ssd` call, as every backend receives them (checked, not yet converted)."""

    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    chunk_size: int = 64
    D: Tensor | None = None
    z: Tensor | None = None
    dt_bias: Tensor | None = None
    initial_states: Tensor | None = None
    seq_idx: Tensor | None = None
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    return_final_states: bool = False

    def scan_inputs(self, *, skip_in_scan: bool = False) -> ScanInputs:
        """The scan our own backends run: ``dt`` through :func:`prepare_dt`, half precision in float32.

        ``skip_in_scan``: a per-head skip ``D`` (shape (h,)) becomes the scan's diagonal, so the scan adds
        ``D x`` in place instead of two full-size passes after it (:meth:`finish` then leaves it out)."""
        dt = prepare_dt(self.dt, self.dt_bias, self.dt_softplus, self.dt_limit)
        x, B, C, init = upcast(self.x, self.B, self.C, self.initial_states)
        forward = Direction(dt=dt.to(x.dtype), A=self.A.to(x.dtype), B=B, C=C)
        diag = None
        if skip_in_scan and self.D is not None and self.D.dim() == 1:
            diag = self.D.to(x.dtype).expand(*x.shape[:3])                                 # (b, l, h), a view
        return ScanInputs(x=x, forward=forward, diag=diag, seq_idx=self.seq_idx, initial_state=init,
                          chunk_size=self.chunk_size)

    def finish(self, inputs: ScanInputs, y: Tensor, final: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
        """``y`` of the scan of ``inputs``, with the skip ``D x`` (unless the scan added it as its diagonal) and the
        ``silu(z)`` gate, in x's dtype (and the final states when asked for)."""
        if self.D is not None and inputs.diag is None:
            y = y + inputs.x * (self.D[:, None] if self.D.dim() == 1 else self.D).to(y.dtype)
        if self.z is not None:
            y = y * F.silu(self.z.to(y.dtype))
        y = y.to(self.x.dtype)
        return (y, final) if self.return_final_states else y


def ssd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 64,
    D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None, seq_idx: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf), return_final_states: bool = False, *,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal SSD (Mamba-2): ``y_t = sum_{s<=t} C_t.B_s exp(A sum_{k=s+1..t} dt_k) dt_s x_s (+ D x_t)``.

    Args follow ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``: x (b, l, h, p), dt (b, l, h),
    A (h,), B and C (b, l, g, n), D (h,) or (h, p), z (b, l, h, p) (output gated by SiLU(z)), dt_bias (h,),
    initial_states (b, h, p, n), seq_idx (b, l) integer segment ids of packed sequences: a new segment starts
    wherever the id changes along the row ([0, 0, 1, 1, 0, 0] is three segments; a reused id is a new segment),
    and no state crosses a segment start. The same in every backend.
    Returns y (b, l, h, p), and the final states (b, h, p, n) when ``return_final_states``.
    ``backend``: see :mod:`mixer_plugins.kernels`.
    """
    b, l, h, p, g, n = check_generators("ssd", x, dt, A, B, C)
    check(chunk_size > 0, f"ssd: chunk_size must be positive, got {chunk_size}")
    if D is not None:
        check(tuple(D.shape) in ((h,), (h, p)), f"ssd: D must be (heads,) or (heads, head_dim), got {tuple(D.shape)}")
    if z is not None:
        check(z.shape == x.shape, f"ssd: z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None:
        check(tuple(dt_bias.shape) == (h,), f"ssd: dt_bias must be ({h},), got {tuple(dt_bias.shape)}")
    if initial_states is not None:
        check(tuple(initial_states.shape) == (b, h, p, n),
              f"ssd: initial_states must be {(b, h, p, n)}, got {tuple(initial_states.shape)}")
    seq_idx = check_seq_idx("ssd", seq_idx, b, l, x.device)  # normalised once, for every backend
    args = SSDArgs(x=x, dt=dt, A=A, B=B, C=C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                   initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   return_final_states=return_final_states)
    return resolve_backend("ssd", backend, x.device, args)(args)


discover_backends("ssd", __name__)
