"""One scan direction, for the bidirectional heuristics that combine the two non-additively (mult, concat).

Backends: ``reference`` (materialized, float64-capable), ``torch`` (chunked, O(L) memory; the CPU default),
``triton`` (our fused kernel; first on CUDA) and ``mamba_ssm`` (mamba-ssm's Triton SSD, the sequence flipped for
``reverse``; CUDA). Each is a module of this folder that registers itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from .._checks import check
from .._dispatch import discover_backends, resolve_backend
from .._scan import Direction, ScanInputs, check_generators, check_seq_idx, prepare_dt, upcast

__all__ = ["DirectionalScanArgs", "directional_scan"]


@dataclass(frozen=True)
class DirectionalScanArgs:
    """The arguments of one :func:`directional_scan` call, as every backend receives them (checked)."""

    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    reverse: bool = False
    shift: bool = False
    chunk_size: int = 64
    dt_bias: Tensor | None = None
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    seq_idx: Tensor | None = None

    def scan_inputs(self) -> ScanInputs:
        """The scan our own backends run: ``dt`` through :func:`prepare_dt`, half precision in float32, the
        generators on the forward (lower) or, when ``reverse``, the backward (upper) side."""
        x, B, C = upcast(self.x, self.B, self.C)
        dt = prepare_dt(self.dt, self.dt_bias, self.dt_softplus, self.dt_limit).to(x.dtype)
        direction = Direction(dt=dt, A=self.A.to(x.dtype), B=B, C=C)
        side = {"backward": direction} if self.reverse else {"forward": direction}
        return ScanInputs(x=x, seq_idx=self.seq_idx, shift=self.shift, chunk_size=self.chunk_size, **side)


def directional_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, reverse: bool = False, shift: bool = False,
    chunk_size: int = 64, dt_bias: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf), seq_idx: Tensor | None = None, backend: str | None = None,
) -> Tensor:
    """One scan direction: the causal SSD (``reverse=False``) or its mirror image at original positions,
    ``flip(SS(flip x))`` (``reverse=True``); ``shift=True`` moves it one step off the diagonal (Hydra).

    Shapes as :func:`mixer_plugins.kernels.quasiseparable`; ``seq_idx`` (b, l) as there: a new segment starts
    wherever the id changes along the row ([0, 0, 1, 1, 0, 0] is three segments), and no scan or shift crosses
    a segment start. ``backend``: see :mod:`mixer_plugins.kernels`.
    """
    b, l, *_ = check_generators("directional_scan", x, dt, A, B, C)
    check(chunk_size > 0, f"directional_scan: chunk_size must be positive, got {chunk_size}")
    seq_idx = check_seq_idx("directional_scan", seq_idx, b, l, x.device)  # normalised once, for every backend
    args = DirectionalScanArgs(x=x, dt=dt, A=A, B=B, C=C, reverse=reverse, shift=shift, chunk_size=chunk_size,
                               dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx)
    return resolve_backend("directional_scan", backend, x.device, args)(args)


discover_backends("directional_scan", __name__)
