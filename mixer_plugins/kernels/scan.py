"""Public scan ops: :func:`ssd` (causal, Mamba-2) and :func:`quasiseparable` (bidirectional, Hydra).

Both dispatch to a backend (see :mod:`.dispatch`): ``torch`` (chunked, O(L) memory, default on CPU),
``reference`` (materialized O(L^2), float64-capable), ``mamba_ssm`` (fused Triton SSD on CUDA when the
package imports).

:func:`ssd` follows the argument conventions of mamba_ssm's ``mamba_chunk_scan_combined`` so code and
tests move freely between the two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import MixerInputError
from .custom_ops import chunked_scan
from .dispatch import register_backend, resolve_backend
from .scan_chunked import scan_chunked
from .scan_reference import scan_reference

__all__ = ["ssd", "quasiseparable", "directional_scan", "prepare_dt"]


# -- argument handling ------------------------------------------------------------------------------

def _check(cond: bool, message: str) -> None:
    if not cond:
        raise MixerInputError(message)


def _check_scan_args(name: str, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[int, ...]:
    _check(x.dim() == 4, f"{name}: x must be (batch, length, heads, head_dim), got shape {tuple(x.shape)}")
    b, l, h, p = x.shape
    _check(tuple(dt.shape) == (b, l, h), f"{name}: dt must be (batch, length, heads) = {(b, l, h)}, "
                                         f"got {tuple(dt.shape)}")
    _check(tuple(A.shape) == (h,), f"{name}: A must be (heads,) = ({h},), got {tuple(A.shape)}")
    _check(B.dim() == 4 and B.shape[:2] == (b, l), f"{name}: B must be (batch, length, groups, state), "
                                                  f"got {tuple(B.shape)}")
    _check(C.shape == B.shape, f"{name}: C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    g, n = B.shape[2], B.shape[3]
    _check(h % g == 0, f"{name}: heads ({h}) must be a multiple of groups ({g})")
    return b, l, h, p, g, n


def prepare_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool,
               dt_limit: tuple[float, float]) -> Tensor:
    """Step sizes as the scan uses them: ``clamp(softplus?(dt + dt_bias), *dt_limit)`` in float32 or wider."""
    if dt.dtype in (torch.float16, torch.bfloat16):
        dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _run_chunked(x: Tensor, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, init, shift: bool,
                 chunk_size: int) -> tuple[Tensor, Tensor | None]:
    """The chunked scan: plain autograd in eager mode (fastest), the custom op under ``torch.compile``.

    Eager autograd keeps the intra-chunk tensors for the backward (memory O(L * chunk_size) per head, linear
    in L); the custom op is opaque to the compiler (fake kernel) and recomputes them in its backward.
    """
    if torch.compiler.is_compiling():
        y, final = chunked_scan(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, init, bool(shift),
                                int(chunk_size))
        return y, (final if dt_f is not None else None)
    if dt_f is not None:
        return scan_chunked(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, init, shift=shift,
                            chunk_size=chunk_size, return_final_state=True)
    return scan_chunked(x, None, None, None, None, dt_b, A_b, B_b, C_b, diag, seq_idx, None, shift=shift,
                        chunk_size=chunk_size), None


def _upcast(*tensors: Tensor | None) -> list[Tensor | None]:
    """Half-precision inputs are scanned in float32 (as mamba-ssm does); float32/float64 stay as they are."""
    return [t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]


# -- ssd --------------------------------------------------------------------------------------------

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
    initial_states (b, h, p, n), seq_idx (b, l) (states reset where it changes; packed sequences).
    Returns y (b, l, h, p), and the final states (b, h, p, n) when ``return_final_states``.
    """
    b, l, h, p, g, n = _check_scan_args("ssd", x, dt, A, B, C)
    _check(chunk_size > 0, f"ssd: chunk_size must be positive, got {chunk_size}")
    if D is not None:
        _check(tuple(D.shape) in ((h,), (h, p)), f"ssd: D must be (heads,) or (heads, head_dim), got {tuple(D.shape)}")
    if z is not None:
        _check(z.shape == x.shape, f"ssd: z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None:
        _check(tuple(dt_bias.shape) == (h,), f"ssd: dt_bias must be ({h},), got {tuple(dt_bias.shape)}")
    if initial_states is not None:
        _check(tuple(initial_states.shape) == (b, h, p, n),
               f"ssd: initial_states must be {(b, h, p, n)}, got {tuple(initial_states.shape)}")
    if seq_idx is not None:
        _check(tuple(seq_idx.shape) == (b, l) and not seq_idx.is_floating_point(),
               f"ssd: seq_idx must be an integer (batch, length) tensor, got {tuple(seq_idx.shape)} {seq_idx.dtype}")
    impl = resolve_backend("ssd", backend, x.device)
    return impl(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
                return_final_states)


def _ssd_epilogue(y: Tensor, x: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D).to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def _ssd_local(use_reference: bool):
    def impl(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
             return_final_states):
        out_dtype = x.dtype
        delta = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
        xs, Bs, Cs, init = _upcast(x, B, C, initial_states)
        delta = delta.to(xs.dtype)
        A_s = A.to(xs.dtype)
        if use_reference:
            result = scan_reference(xs, delta, A_s, Bs, Cs, seq_idx=seq_idx, initial_state=init,
                                    return_final_state=True)
        else:
            result = _run_chunked(xs, delta, A_s, Bs, Cs, None, None, None, None, None, seq_idx, init, False,
                                  chunk_size)
        y, final = result
        y = _ssd_epilogue(y, xs, D, z).to(out_dtype)
        return (y, final) if return_final_states else y

    return impl


register_backend("ssd", "torch")(_ssd_local(use_reference=False))
register_backend("ssd", "reference")(_ssd_local(use_reference=True))


@register_backend("ssd", "mamba_ssm")
def _ssd_mamba_ssm(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit,
                   return_final_states):  # pragma: no cover - needs CUDA and mamba-ssm
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
    )


# -- quasiseparable ---------------------------------------------------------------------------------

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
    seq_idx (b, l): tokens interact only within a segment (neither the scans nor the shift cross one).
    """
    _check_scan_args("quasiseparable", x, dt, A, B, C)
    dt_bwd = dt if dt_bwd is None else dt_bwd
    B_bwd = B if B_bwd is None else B_bwd
    C_bwd = C if C_bwd is None else C_bwd
    A_bwd = A if A_bwd is None else A_bwd
    _check_scan_args("quasiseparable (backward direction)", x, dt_bwd, A_bwd, B_bwd, C_bwd)
    b, l, h = dt.shape
    if diag is not None:
        _check(tuple(diag.shape) == (b, l, h), f"quasiseparable: diag must be (batch, length, heads) = {(b, l, h)}, "
                                               f"got {tuple(diag.shape)}")
    if seq_idx is not None:
        _check(tuple(seq_idx.shape) == (b, l) and not seq_idx.is_floating_point(),
               "quasiseparable: seq_idx must be an integer (batch, length) tensor")
    _check(chunk_size > 0, f"quasiseparable: chunk_size must be positive, got {chunk_size}")
    impl = resolve_backend("quasiseparable", backend, x.device)
    return impl(x, dt, A, B, C, dt_bwd, A_bwd, B_bwd, C_bwd, diag, shift, chunk_size, dt_bias, dt_softplus,
                dt_limit, seq_idx)


def _qs_local(use_reference: bool):
    def impl(x, dt, A, B, C, dt_bwd, A_bwd, B_bwd, C_bwd, diag, shift, chunk_size, dt_bias, dt_softplus, dt_limit,
             seq_idx):
        out_dtype = x.dtype
        xs, Bf, Cf, Bb, Cb, dg = _upcast(x, B, C, B_bwd, C_bwd, diag)
        dt_f = prepare_dt(dt, dt_bias, dt_softplus, dt_limit).to(xs.dtype)
        dt_b = prepare_dt(dt_bwd, dt_bias, dt_softplus, dt_limit).to(xs.dtype)
        Af, Ab = A.to(xs.dtype), A_bwd.to(xs.dtype)
        if use_reference:
            y = scan_reference(xs, dt_f, Af, Bf, Cf, dt_b, Ab, Bb, Cb, dg, seq_idx, shift=shift)
        else:
            y, _ = _run_chunked(xs, dt_f, Af, Bf, Cf, dt_b, Ab, Bb, Cb, dg, seq_idx, None, shift, chunk_size)
        return y.to(out_dtype)

    return impl


register_backend("quasiseparable", "torch")(_qs_local(use_reference=False))
register_backend("quasiseparable", "reference")(_qs_local(use_reference=True))


@register_backend("quasiseparable", "mamba_ssm")
def _qs_mamba_ssm(x, dt, A, B, C, dt_bwd, A_bwd, B_bwd, C_bwd, diag, shift, chunk_size, dt_bias, dt_softplus,
                  dt_limit, seq_idx):  # pragma: no cover - needs CUDA and mamba-ssm
    # mamba-ssm has only the causal kernel: run it on the sequence and on its flip. Packed sequences would
    # need per-segment flips, so they are refused rather than silently mixed.
    if seq_idx is not None:
        raise MixerInputError("the mamba_ssm backend of quasiseparable does not support seq_idx; use backend='torch'")
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    kw = dict(dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    y_f = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, **kw)
    y_b = mamba_chunk_scan_combined(x.flip(1), dt_bwd.flip(1), A_bwd, B_bwd.flip(1), C_bwd.flip(1), chunk_size,
                                    **kw).flip(1)
    if shift:
        y_f = F.pad(y_f[:, :-1], (0, 0, 0, 0, 1, 0))
        y_b = F.pad(y_b[:, 1:], (0, 0, 0, 0, 0, 1))
    y = y_f + y_b
    if diag is not None:
        y = y + diag[..., None].to(y.dtype) * x
    return y


# -- one direction ----------------------------------------------------------------------------------

def directional_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, reverse: bool = False, shift: bool = False,
    chunk_size: int = 64, dt_bias: Tensor | None = None, dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf), seq_idx: Tensor | None = None, backend: str | None = None,
) -> Tensor:
    """One scan direction: the causal SSD (``reverse=False``) or its mirror image at original positions,
    ``flip(SS(flip x))`` (``reverse=True``); ``shift=True`` moves it one step off the diagonal (Hydra).

    Used by the bidirectional heuristics that combine the two directions non-additively (mult, concat).
    """
    _check_scan_args("directional_scan", x, dt, A, B, C)
    _check(chunk_size > 0, f"directional_scan: chunk_size must be positive, got {chunk_size}")
    impl = resolve_backend("directional_scan", backend, x.device)
    return impl(x, dt, A, B, C, reverse, shift, chunk_size, dt_bias, dt_softplus, dt_limit, seq_idx)


def _directional_local(use_reference: bool):
    def impl(x, dt, A, B, C, reverse, shift, chunk_size, dt_bias, dt_softplus, dt_limit, seq_idx):
        out_dtype = x.dtype
        xs, Bs, Cs = _upcast(x, B, C)
        delta = prepare_dt(dt, dt_bias, dt_softplus, dt_limit).to(xs.dtype)
        As = A.to(xs.dtype)
        gens = (delta, As, Bs, Cs)
        fwd, bwd = (gens, (None,) * 4) if not reverse else ((None,) * 4, gens)
        if use_reference:
            y = scan_reference(xs, *fwd, *bwd, None, seq_idx, shift=shift)
        else:
            y, _ = _run_chunked(xs, *fwd, *bwd, None, seq_idx, None, shift, chunk_size)
        return y.to(out_dtype)

    return impl


register_backend("directional_scan", "torch")(_directional_local(use_reference=False))
register_backend("directional_scan", "reference")(_directional_local(use_reference=True))
