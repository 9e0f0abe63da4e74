"""The selective scans of the SSM mixers: one algorithm, its forms, and three public functions over it.

* :func:`ssd` — causal Mamba-2 SSD, with mamba-ssm's ``mamba_chunk_scan_combined`` argument conventions;
* :func:`quasiseparable` — the bidirectional (Hydra) scan: both directions, the shift and the diagonal in one call;
* :func:`directional_scan` — one direction of either (for the non-additive bidirectional heuristics);
* :func:`scan_matrix` / :func:`scan_reference` — the materialized matrix (what ``materialize`` returns), the oracle.

Each builds one :class:`ScanArgs` and runs the ``scan`` op on the backend the dispatcher picks by device, dtype and
shape (never by values; see :mod:`mixer_plugins.kernels`). The forms, one module each:

* ``reference`` (:mod:`.reference`) — the materialized L x L matrix; exact in float64; never chosen automatically;
* ``torch`` (:mod:`.torch`, the algorithm in :mod:`.chunked`) — the chunked algorithm in plain PyTorch, in named
  phases (chunk cumsum, chunk states, state passing, chunk output); any device and dtype, compile and export;
* ``native`` (:mod:`.native`) — our C++ engine; the CPU default for float32/float64 without ``seq_idx``;
* ``triton`` (:mod:`.triton`, kernels in :mod:`.triton_kernels`) — both directions fused; the CUDA default;
* ``mamba_ssm`` (:mod:`.mamba_ssm`) — mamba-ssm's Triton SSD where it imports (CUDA).
"""

from __future__ import annotations

import math
from typing import Literal, overload

from torch import Tensor

from .._checks import check
from .._dispatch import discover_backends, resolve_backend
from .flops import chunked_scan_flops
from .inputs import (
    Direction,
    ScanArgs,
    ScanInputs,
    check_generators,
    check_seq_idx,
    chunk_length,
    normalize_seq_idx,
    prepare_dt,
)
from .reference import reference_scan, scan_matrix, scan_reference

__all__ = ["Direction", "ScanArgs", "ScanInputs", "chunk_length", "chunked_scan_flops", "directional_scan",
           "normalize_seq_idx", "prepare_dt", "quasiseparable", "reference_scan", "run_scan", "scan_matrix",
           "scan_reference", "ssd"]

DtLimit = tuple[float, float]


def run_scan(args: ScanArgs, backend: str | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Run the ``scan`` op on ``args`` with ``backend`` (or the dispatcher's choice): the output, and the final state
    when ``args.return_final_state``."""
    return resolve_backend("scan", backend, args.x.device, args)(args)


def _rates(name: str, A: Tensor | None, A_log: Tensor | None) -> Tensor:
    """The tensor a direction carries as its ``A``: ``A``, or ``A_log`` (then :attr:`ScanArgs.A_is_log`); exactly one
    of the two."""
    check((A is None) != (A_log is None), f"{name}: pass A or A_log (A = -exp(A_log)), exactly one")
    return A if A is not None else A_log  # type: ignore[return-value]


def _run_scan_output(args: ScanArgs, backend: str | None) -> Tensor:
    """:func:`run_scan` of ``args`` that ask for no final state: the output alone."""
    out = run_scan(args, backend)
    assert isinstance(out, Tensor), "a scan without return_final_state returns its output alone"
    return out


@overload
def ssd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 64,
    D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None, seq_idx: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: DtLimit = (0.0, math.inf), return_final_states: Literal[False] = False, *,
    backend: str | None = None,
) -> Tensor: ...


@overload
def ssd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 64,
    D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None, seq_idx: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: DtLimit = (0.0, math.inf), *, return_final_states: Literal[True],
    backend: str | None = None,
) -> tuple[Tensor, Tensor]: ...


@overload
def ssd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 64,
    D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None, seq_idx: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: DtLimit = (0.0, math.inf), return_final_states: bool = False, *,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]: ...


def ssd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 64,
    D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None, seq_idx: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: DtLimit = (0.0, math.inf), return_final_states: bool = False, *,
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
    args = ScanArgs(x=x, forward=Direction(dt, A, B, C), seq_idx=check_seq_idx("ssd", seq_idx, b, l, x.device),
                    initial_state=initial_states, chunk_size=chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
                    dt_limit=dt_limit, D=D, z=z, return_final_state=return_final_states)
    return run_scan(args, backend)


def quasiseparable(
    x: Tensor, dt: Tensor, A: Tensor | None, B: Tensor, C: Tensor, *,
    dt_bwd: Tensor | None = None, B_bwd: Tensor | None = None, C_bwd: Tensor | None = None,
    A_bwd: Tensor | None = None, diag: Tensor | None = None, shift: bool = True, chunk_size: int = 64,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, dt_limit: DtLimit = (0.0, math.inf),
    seq_idx: Tensor | None = None, A_log: Tensor | None = None, backend: str | None = None,
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
    ``A_log`` (h,), in place of ``A`` (then None) for both directions: ``A = -exp(A_log)``, formed in float32 (or
    wider) by every backend, inside the kernels on the ``triton`` one (no ``A_bwd`` with it).
    ``backend``: see :mod:`mixer_plugins.kernels`.
    """
    A = _rates("quasiseparable", A, A_log)
    check(A_log is None or A_bwd is None, "quasiseparable: A_bwd cannot be combined with A_log")
    b, l, h = check_generators("quasiseparable", x, dt, A, B, C)[:3]
    backward = Direction(dt if dt_bwd is None else dt_bwd, A if A_bwd is None else A_bwd,
                         B if B_bwd is None else B_bwd, C if C_bwd is None else C_bwd)
    if any(t is not None for t in (dt_bwd, A_bwd, B_bwd, C_bwd)):   # else it is the forward's, checked just above
        check_generators("quasiseparable (backward direction)", x, backward.dt, backward.A, backward.B, backward.C)
    if diag is not None:
        check(tuple(diag.shape) == (b, l, h), f"quasiseparable: diag must be (batch, length, heads) = {(b, l, h)}, "
                                              f"got {tuple(diag.shape)}")
    check(chunk_size > 0, f"quasiseparable: chunk_size must be positive, got {chunk_size}")
    args = ScanArgs(x=x, forward=Direction(dt, A, B, C), backward=backward, diag=diag,
                    seq_idx=check_seq_idx("quasiseparable", seq_idx, b, l, x.device), shift=shift,
                    chunk_size=chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                    A_is_log=A_log is not None)
    return _run_scan_output(args, backend)


def directional_scan(
    x: Tensor, dt: Tensor, A: Tensor | None, B: Tensor, C: Tensor, *, reverse: bool = False, shift: bool = False,
    chunk_size: int = 64, dt_bias: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: DtLimit = (0.0, math.inf), seq_idx: Tensor | None = None, A_log: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """One scan direction: the causal SSD (``reverse=False``) or its mirror image at original positions,
    ``flip(SS(flip x))`` (``reverse=True``); ``shift=True`` moves it one step off the diagonal (Hydra).

    Shapes as :func:`quasiseparable`; ``seq_idx`` (b, l) as there: a new segment starts wherever the id changes
    along the row ([0, 0, 1, 1, 0, 0] is three segments), and no scan or shift crosses a segment start. ``A_log``
    in place of ``A`` as there.
    ``backend``: see :mod:`mixer_plugins.kernels`.
    """
    A = _rates("directional_scan", A, A_log)
    b, l, *_ = check_generators("directional_scan", x, dt, A, B, C)
    check(chunk_size > 0, f"directional_scan: chunk_size must be positive, got {chunk_size}")
    direction = Direction(dt, A, B, C)
    args = ScanArgs(x=x, forward=None if reverse else direction, backward=direction if reverse else None,
                    seq_idx=check_seq_idx("directional_scan", seq_idx, b, l, x.device), shift=shift,
                    chunk_size=chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                    A_is_log=A_log is not None)
    return _run_scan_output(args, backend)


discover_backends("scan", __name__)
