"""The bidirectional (Hydra) scan: forward + backward + shift + diagonal, in one pass.

Backends: ``reference`` (materialized, float64-capable), ``torch`` (chunked, O(L) memory; the CPU default),
``mamba_ssm`` (mamba-ssm's causal kernel run on the sequence and on its flip; CUDA). Each is a module of this
folder that registers itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from .._checks import check
from .._dispatch import discover_backends, resolve_backend
from .._scan import Direction, ScanInputs, check_generators, check_seq_idx, prepare_dt, upcast

__all__ = ["QuasiseparableArgs", "quasiseparable"]


@dataclass(frozen=True)
class QuasiseparableArgs:
    """The arguments of one :func:`quasiseparable` call, as every backend receives them: checked, with the
    backward direction's generators filled in (``*_bwd`` default to the forward ones)."""

    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    dt_bwd: Tensor
    A_bwd: Tensor
    B_bwd: Tensor
    C_bwd: Tensor
    diag: Tensor | None = None
    shift: bool = True
    chunk_size: int = 64
    dt_bias: Tensor | None = None
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    seq_idx: Tensor | None = None

    def scan_inputs(self) -> ScanInputs:
        """The scan our own backends run: both ``dt`` through :func:`prepare_dt`, half precision in float32."""
        x, B, C, B_bwd, C_bwd, diag = upcast(self.x, self.B, self.C, self.B_bwd, self.C_bwd, self.diag)
        dt = prepare_dt(self.dt, self.dt_bias, self.dt_softplus, self.dt_limit).to(x.dtype)
        dt_bwd = prepare_dt(self.dt_bwd, self.dt_bias, self.dt_softplus, self.dt_limit).to(x.dtype)
        return ScanInputs(x=x, forward=Direction(dt=dt, A=self.A.to(x.dtype), B=B, C=C),
                          backward=Direction(dt=dt_bwd, A=self.A_bwd.to(x.dtype), B=B_bwd, C=C_bwd),
                          diag=diag, seq_idx=self.seq_idx, shift=self.shift, chunk_size=self.chunk_size)


def quasiseparable(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *,
    dt_bwd: Tensor | None = None, B_bwd: Tensor | None = None, C_bwd: Tensor | None = None,
    A_bwd: Tensor | None = None, diag: Tensor | None = None, shift: bool = True, chunk_size: int = 64,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
    seq_idx: Tensor | None = None, backend: str | None = None,
) -> Tensor:
    """Bidirectional scan: ``y = lower(x) + upper(x) + diag * x`` with a quasiseparable matrix.

    With ``shift=True`` (Hydra): ``lower = shift(SS_f(x))``, ``upper = flip(shift(SS_b(flip x)))``, whose
    entries are ``C_{f,i-1}.B_{f,j} exp(A sum_{k=j+1..i-1} dt_k) dt_j`` below the diagonal and
    ``C_{b,i+1}.B_{b,j} exp(A sum_{k=i+1..j-1} dt^b_k) dt^b_j`` above it; the diagonal is ``diag`` alone.
    With ``shift=False`` (the "add" bidirectional heuristic) both directions also contribute their own
    diagonal. The backward direction defaults to the forward generators (``dt``, ``B``, ``C``, ``A``): the
    shared-B,C form of the paper's quasiseparable mixer; Hydra passes separate ``*_bwd`` tensors.

    Shapes: x (b, l, h, p); dt, dt_bwd, diag (b, l, h); A, A_bwd, dt_bias (h,); B, C, B_bwd, C_bwd (b, l, g, n);
    seq_idx (b, l) integer segment ids of packed sequences: a new segment starts wherever the id changes along
    the row ([0, 0, 1, 1, 0, 0] is three segments; a reused id is a new segment); tokens interact only within a
    segment (neither the scans nor the shift cross one). The same in every backend.
    ``backend``: see :mod:`mixer_plugins.kernels`.
    """
    check_generators("quasiseparable", x, dt, A, B, C)
    dt_bwd = dt if dt_bwd is None else dt_bwd
    B_bwd = B if B_bwd is None else B_bwd
    C_bwd = C if C_bwd is None else C_bwd
    A_bwd = A if A_bwd is None else A_bwd
    check_generators("quasiseparable (backward direction)", x, dt_bwd, A_bwd, B_bwd, C_bwd)
    b, l, h = dt.shape
    if diag is not None:
        check(tuple(diag.shape) == (b, l, h), f"quasiseparable: diag must be (batch, length, heads) = {(b, l, h)}, "
                                              f"got {tuple(diag.shape)}")
    seq_idx = check_seq_idx("quasiseparable", seq_idx, b, l, x.device)  # normalised once, for every backend
    check(chunk_size > 0, f"quasiseparable: chunk_size must be positive, got {chunk_size}")
    args = QuasiseparableArgs(x=x, dt=dt, A=A, B=B, C=C, dt_bwd=dt_bwd, A_bwd=A_bwd, B_bwd=B_bwd, C_bwd=C_bwd,
                              diag=diag, shift=shift, chunk_size=chunk_size, dt_bias=dt_bias,
                              dt_softplus=dt_softplus, dt_limit=dt_limit, seq_idx=seq_idx)
    return resolve_backend("quasiseparable", backend, x.device, args)(args)


discover_backends("quasiseparable", __name__)
