"""The selective scans of the SSM mixers: one algorithm, its forms, and three public functions over it.

* :func:`ssd` — causal Mamba-2 SSD, with mamba-ssm's ``mamba_chunk_scan_combined`` argument conventions;
* :func:`quasiseparable` — the bidirectional (Hydra) scan: both directions, the shift and the diagonal in one call;
* :func:`directional_scan` — one direction of either (for the non-additive bidirectional heuristics);
* :func:`scan_matrix` / :func:`scan_reference` — the materialized matrix (what ``materialize`` returns), the oracle.

Each checks its arguments and calls :func:`_scan`, which names the form that runs (:data:`SCAN`, chosen by device,
dtype and shape, never by values; see :mod:`mixer_plugins.kernels`). The forms, one module each:

* ``reference`` (:mod:`.reference`) — the materialized L x L matrix; exact in float64; never chosen automatically;
* ``torch`` (:mod:`.chunked`) — the chunked algorithm in plain PyTorch, in named phases (chunk cumsum, chunk
  states, state passing, chunk output); any device and dtype, compile and export;
* ``native`` (:mod:`.native`) — our C++ engine; the CPU default for float32/float64 without ``seq_idx``;
* ``triton`` (:mod:`.triton_one_chunk` for a sequence that is one chunk and carries no state, else
  :mod:`.triton_kernels`) — both directions fused, step sizes prepared inside; the CUDA default;
* ``mamba_ssm`` (:mod:`.mamba_ssm`) — mamba-ssm's Triton SSD where it imports (CUDA).
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check
from .._dispatch import Op
from .._native_check import native_unavailable
from .._requirements import triton_unavailable
from .chunked import scan_chunked
from .flops import chunked_scan_flops
from .inputs import Direction, check_generators, check_seq_idx, chunk_length, normalize_seq_idx, prepare_dt
from .mamba_ssm import load as load_mamba_ssm
from .mamba_ssm import mamba_ssm_scan, mamba_ssm_unavailable
from .native import scan_native
from .reference import reference_scan, scan_matrix, scan_reference

__all__ = ["ONE_CHUNK_MAX", "SCAN", "Direction", "chunk_length", "chunked_scan_flops", "directional_scan",
           "normalize_seq_idx", "prepare_dt", "quasiseparable", "reference_scan", "scan_matrix", "scan_reference",
           "ssd", "uses_one_chunk"]

DtLimit = tuple[float, float]

#: the longest sequence the Triton one-chunk kernels take (their tiles of keys and queries cover it in a few steps)
ONE_CHUNK_MAX = 256


def uses_one_chunk(x: Tensor, state: int, chunk_size: int, carries_state: bool) -> bool:
    """Whether a Triton scan of ``x`` (b, l, h, p) runs on the one-chunk kernels: one chunk long
    (:func:`chunk_length`), at most :data:`ONE_CHUNK_MAX` tokens, and no initial or final state."""
    _, length, heads, head_dim = x.shape
    if length > ONE_CHUNK_MAX or carries_state:
        return False
    return chunk_length(length, chunk_size, heads, head_dim, state) >= length


def _why_not(backend: str, device: torch.device, *, x: Tensor | None = None, others: tuple[Any, ...] = (),
             seq_idx: Tensor | None = None, carries_state: bool = False, causal: bool = True) -> str | None:
    """Why ``backend`` cannot run a scan of ``x`` on ``device`` (``None`` when it can): ``others``, the call's other
    tensors (None allowed); ``carries_state``: an initial state given or the final one asked for; ``causal``: one
    unshifted forward direction with no diagonal (a call mamba-ssm runs whole)."""
    if backend == "native":
        if seq_idx is not None:
            return "the native engine does not take seq_idx (packed sequences run on the torch backend)"
        if x is None:
            return native_unavailable(device)
        if x.numel() == 0:
            return "empty input"
        return native_unavailable(device, [x, *(t for t in others if t is not None)])
    if backend == "triton":
        return triton_unavailable(device, None if x is None else x.dtype)
    if backend == "mamba_ssm":
        return mamba_ssm_unavailable(device, carries_state=carries_state and not causal)
    return None  # reference, torch: any device and dtype


#: The scan's forms, and the automatic order per device type (the first that can run the call runs it).
SCAN = Op("scan", backends=("reference", "torch", "native", "triton", "mamba_ssm"),
          automatic={"cuda": ("triton", "mamba_ssm", "torch"), "cpu": ("native", "torch")}, why_not=_why_not,
          symbolic_length="reference")
"""The scan's backends. While the ONNX exporter traces with a symbolic length, ``reference``: the ``torch`` form
loops over its chunks in Python, so the exporter would fix their number (and with it the length) to the example's;
the materialized ``L x L`` matrix is standard ops of any length."""


def _scan(x: Tensor, forward: Direction | None, backward: Direction | None = None, *, diag: Tensor | None = None,
          seq_idx: Tensor | None = None, initial_state: Tensor | None = None, shift: bool = False,
          chunk_size: int = 64, dt_bias: Tensor | None = None, dt_softplus: bool = False,
          dt_limit: DtLimit = (0.0, math.inf), A_is_log: bool = False, D: Tensor | None = None,
          z: Tensor | None = None, return_final_state: bool = False,
          backend: str | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """One checked scan on the chosen form: the directions with raw ``dt`` (``A`` holding ``A_log`` when
    ``A_is_log``), ``seq_idx`` normalised; SSD's skip ``D`` and ``silu(z)`` gate applied after it."""
    d = forward if forward is not None else backward
    assert d is not None, "a scan needs at least one direction"
    carries_state = initial_state is not None or return_final_state
    others = (*(forward or ()), *(backward or ()), diag, initial_state, dt_bias, D, z)
    name = SCAN.choose(backend, x.device, x=x, others=others, seq_idx=seq_idx, carries_state=carries_state,
                       causal=backward is None and not shift and diag is None)
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype  # half precision in float32
    skip = _skip_as_diag(diag, D, x)
    dt_options: dict[str, Any] = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if name == "triton":  # raw step sizes and A_log go into the kernels; every tensor in its own dtype and strides
        generators = (*_generators(forward), *_generators(backward), skip, seq_idx)
        if uses_one_chunk(x, d.B.shape[-1], chunk_size, carries_state):
            from .triton_one_chunk import scan_one_chunk

            return _finish(scan_one_chunk(x, *generators, shift=shift, a_log=A_is_log, **dt_options), x, D, z)
        from .triton_kernels import scan_triton

        return _finish(scan_triton(x, *generators, initial_state, shift=shift, chunk_size=chunk_size,
                                   return_final_state=return_final_state, a_log=A_is_log, **dt_options), x, D, z)
    if name == "mamba_ssm":  # takes A itself and raw step sizes
        forward, backward = _with_rates(forward, A_is_log, compute), _with_rates(backward, A_is_log, compute)
        if forward is not None and backward is None and not shift and diag is None:  # SSD: mamba-ssm's own call
            return load_mamba_ssm()(x, *forward, chunk_size, D=D, z=z, initial_states=initial_state,
                                    seq_idx=seq_idx, return_final_states=return_final_state, **dt_options)
        return _finish(mamba_ssm_scan(x, forward, backward, diag=skip, seq_idx=seq_idx, shift=shift,
                                      chunk_size=chunk_size, **dt_options), x, D, z)

    def prepared(d: Direction | None) -> Direction | None:  # reference, torch, native: prepared step sizes and rates
        if d is None:
            return None
        dt = prepare_dt(d.dt, dt_bias, dt_softplus, dt_limit).to(compute)
        A = -torch.exp(d.A.to(compute)) if A_is_log else d.A.to(compute)
        return Direction(dt, A, d.B.to(compute), d.C.to(compute))

    xc, fwd, bwd = x.to(compute), prepared(forward), prepared(backward)
    common: dict[str, Any] = dict(diag=None if skip is None else skip.to(compute), shift=shift,
                                  initial_state=None if initial_state is None else initial_state.to(compute),
                                  return_final_state=return_final_state)
    if name == "native":
        return _finish(scan_native(xc, fwd, bwd, chunk_size=chunk_size, **common), x, D, z)
    if name == "reference":
        return _finish(reference_scan(xc, fwd, bwd, seq_idx=seq_idx, **common), x, D, z)
    return _finish(scan_chunked(xc, fwd, bwd, seq_idx=seq_idx, chunk_size=chunk_size, **common), x, D, z)


def _generators(d: Direction | None) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """A direction as the Triton kernels take it: dt, A, B, C (four None when absent)."""
    return (None, None, None, None) if d is None else d


def _with_rates(d: Direction | None, A_is_log: bool, dtype: torch.dtype) -> Direction | None:
    """``d`` with ``A = -exp(A_log)`` in ``dtype`` when ``A_is_log`` (for the forms that take ``A`` itself)."""
    return d if d is None or not A_is_log else d._replace(A=-torch.exp(d.A.to(dtype)))


def _skip_as_diag(diag: Tensor | None, D: Tensor | None, x: Tensor) -> Tensor | None:
    """``diag`` with a per-head skip ``D`` (h,) added: the scan then adds ``D x`` in place (a view, no copy)."""
    if D is None or D.dim() != 1:
        return diag
    skip = D.to(diag.dtype if diag is not None else x.dtype).expand(*x.shape[:3])
    return skip if diag is None else diag + skip


def _finish(out: Tensor | tuple[Tensor, Tensor | None], x: Tensor, D: Tensor | None,
            z: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
    """A form's ``y`` (or ``(y, final state)``) with a per-channel skip ``D`` (h, p) added (a per-head one went into
    the diagonal) and the ``silu(z)`` gate applied, in ``x``'s dtype."""
    y, final = out if isinstance(out, tuple) else (out, None)   # (y, None): no final state
    if D is not None and D.dim() == 2:
        y = y + x.to(y.dtype) * D.to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    y = y.to(x.dtype)
    return y if final is None else (y, final)


def _rates(name: str, A: Tensor | None, A_log: Tensor | None) -> Tensor:
    """The tensor a direction carries as its ``A``: ``A``, or ``A_log``; exactly one of the two."""
    check((A is None) != (A_log is None), f"{name}: pass A or A_log (A = -exp(A_log)), exactly one")
    return A if A is not None else A_log  # type: ignore[return-value]


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
    return _scan(x, Direction(dt, A, B, C), seq_idx=check_seq_idx("ssd", seq_idx, b, l, x.device),
                 initial_state=initial_states, chunk_size=chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus,
                 dt_limit=dt_limit, D=D, z=z, return_final_state=return_final_states, backend=backend)


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
    return _scan(x, Direction(dt, A, B, C), backward, diag=diag,  # type: ignore[return-value]
                 seq_idx=check_seq_idx("quasiseparable", seq_idx, b, l, x.device), shift=shift,
                 chunk_size=chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                 A_is_log=A_log is not None, backend=backend)


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
    return _scan(x, None if reverse else direction, direction if reverse else None,  # type: ignore[return-value]
                 seq_idx=check_seq_idx("directional_scan", seq_idx, b, l, x.device), shift=shift,
                 chunk_size=chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                 A_is_log=A_log is not None, backend=backend)
