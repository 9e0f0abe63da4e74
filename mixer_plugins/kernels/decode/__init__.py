"""One decoding step of an SSD-style block, fused: the short convolution's update and the state update in one op.

For one new token per row, with the rolling convolution state (batch, channels, kernel) and the SSD state (batch,
heads, head_dim, d_state), both updated in place::

    u      = conv(conv_state <- [conv_state[1:], xbc]) + bias, then SiLU     the new token's x | B | C
    dt     = clamp(softplus(dt + dt_bias), *dt_limit)                       float32 (or float64), per head
    state <- exp(A dt) state + dt x B^T,  A = -exp(A_log)                   per head (B, C of the head's group)
    y      = scale * state C + D x

what mamba-ssm's ``causal_conv1d_update`` and ``selective_state_update`` do in two kernels. Linear attention is the
case without step sizes or decay (``dt=None``, ``A_log=None``: ``state <- state + x B^T``).

Forms: ``reference`` (the formulas as written, batched; never chosen automatically), ``torch`` (the short
convolution's and the scan's steps as plain ops: any device, what ``torch.compile`` traces), ``native`` (our C++
kernel: one pass per row; the CPU default), ``triton`` (two fused launches; the CUDA default). :data:`DECODE` names
them and the automatic order.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch as _torch  # plain ``torch`` would be shadowed by this package's ``torch`` submodule
from torch import Tensor

from .._checks import check
from .._dispatch import Op
from .._native_check import native_unavailable
from .._requirements import triton_unavailable
from ..norm import NORM, norm_by_name
from .native import decode_native
from .reference import decode_reference
from .torch import decode_torch

__all__ = ["DECODE", "ssd_decode_step"]


def _why_not(backend: str, device: _torch.device, *, state: Tensor | None = None, dt: Tensor | None = None,
             conv_weight: Tensor | None = None, others: tuple[Any, ...] = ()) -> str | None:
    """Why ``backend`` cannot run a step on ``state`` (``None`` when it can); ``others``: the step's other inputs
    (None and numbers allowed)."""
    if backend == "native":
        if state is None or conv_weight is None:
            return native_unavailable(device)
        if not state.is_contiguous():
            return "the native kernel updates a contiguous state in place"
        if dt is not None and dt.stride(-1) != 1:
            return "the native kernel reads dt with contiguous heads"
        return native_unavailable(device, [t for t in (state, conv_weight, dt, *others) if isinstance(t, Tensor)])
    if backend == "triton":
        reason = triton_unavailable(device, None if state is None else state.dtype)
        if reason is not None or state is None or conv_weight is None:
            return reason
        if any(isinstance(t, Tensor) and t.dtype == _torch.float64 for t in (dt, conv_weight, *others)):
            return "the Triton kernels compute in float32 at most; float64 inputs run on the torch backend"
        from .triton_kernels import MAX_D_STATE, MAX_TAPS

        taps, d_state = conv_weight.shape[-1], state.shape[-1]
        if taps > MAX_TAPS:
            return f"a kernel of {taps} taps is over the kernels' limit {MAX_TAPS}; the torch backend takes it"
        if d_state > MAX_D_STATE:
            return f"d_state {d_state} is over the kernels' limit {MAX_D_STATE}; the torch backend takes it"
    return None


#: The step's forms, and the automatic order per device type (the first that can run the call runs it).
DECODE = Op("decode", backends=("reference", "torch", "native", "triton"),
            automatic={"cuda": ("triton", "torch"), "cpu": ("native", "torch")}, why_not=_why_not)


def ssd_decode_step(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, state: Tensor,
                    dt: Tensor | None, A_log: Tensor | None, D: Tensor | float | None = None, *,
                    bc_order: Literal["BC", "CB"] = "BC", dt_bias: Tensor | None = None, dt_softplus: bool = False,
                    dt_limit: tuple[float, float] = (0.0, math.inf), scale: float = 1.0, silu: bool = True,
                    z: Tensor | None = None, norm_weight: Tensor | None = None, eps: float = 1e-5,
                    norm_before_gate: bool = True, backend: str | None = None) -> Tensor:
    """Advance the short convolution's and the SSD state over one new token per row; returns ``y`` (batch,
    heads * head_dim) in ``xbc``'s dtype, or with ``z`` its gated RMSNorm. ``conv_state`` and ``state`` are updated
    in place.

    Args:
        xbc: (batch, channels) the new token's convolution inputs: ``x`` (heads * head_dim channels), then ``B`` and
            ``C`` (groups * d_state each, in ``bc_order``). Any row stride (a view into a fused projection).
        conv_state: (batch, channels, kernel), the last ``kernel`` inputs, oldest first (mamba-ssm's layout).
        conv_weight: (channels, kernel); conv_bias: (channels,) or None.
        state: (batch, heads, head_dim, d_state); its dtype is the one the step computes in (a float32 state
            accumulates a bfloat16 model).
        dt: (batch, heads) step sizes, raw when ``dt_bias``/``dt_softplus``/``dt_limit`` say so (formed as
            :func:`~mixer_plugins.kernels.prepare_dt` does); None: every step size 1.
        A_log: (heads,) the decay rates' logs, ``A = -exp(A_log)`` formed in the step's dtype (float32 or wider);
            None: no decay.
        D: the skip, (heads,), (heads, head_dim), a number, or None (no skip).
        bc_order: ``"BC"`` (Mamba-2's in_proj) or ``"CB"`` (read-out vectors first: linear attention's q, k).
        scale: multiplies the read-out ``state C`` (before the skip is added).
        silu: SiLU after the convolution.
        z, norm_weight, eps, norm_before_gate: given ``z`` (batch, heads * head_dim) and ``norm_weight``
            (heads * head_dim,), the step returns ``gated_rmsnorm(y, z, norm_weight, eps, norm_before_gate)`` over
            each row (:func:`~mixer_plugins.kernels.gated_rmsnorm`), fused into the step where the backend can.
        backend: see :mod:`mixer_plugins.kernels`.
    """
    # messages formed only on failure: this op runs once a token
    check(state.dim() == 4,
          lambda: f"ssd_decode_step: state must be (batch, heads, head_dim, d_state), got {tuple(state.shape)}")
    b, h, p, n = state.shape
    check(xbc.dim() == 2 and xbc.shape[0] == b and xbc.stride(-1) == 1,
          lambda: f"ssd_decode_step: xbc must be (batch={b}, channels) with contiguous channels, got "
                  f"{tuple(xbc.shape)}")
    width = xbc.shape[1]
    groups, rest = divmod(width - h * p, 2 * n)
    check(width > h * p and rest == 0 and groups > 0 and h % groups == 0,
          lambda: f"ssd_decode_step: xbc has {width} channels; x needs heads*head_dim = {h * p} and B, C "
                  f"groups*d_state each (d_state {n}, heads a multiple of groups)")
    check(conv_weight.dim() == 2 and conv_weight.shape[0] == width,
          lambda: f"ssd_decode_step: conv_weight must be ({width}, kernel), got {tuple(conv_weight.shape)}")
    kernel = conv_weight.shape[1]
    check(conv_state.shape == (b, width, kernel),
          lambda: f"ssd_decode_step: conv_state must be {(b, width, kernel)}, got {tuple(conv_state.shape)}")
    check(conv_bias is None or conv_bias.shape == (width,),
          lambda: f"ssd_decode_step: conv_bias must be ({width},), got {tuple(conv_bias.shape)}")  # type: ignore
    check(dt is None or dt.shape == (b, h),
          lambda: f"ssd_decode_step: dt must be {(b, h)}, got {tuple(dt.shape)}")  # type: ignore[union-attr]
    check(A_log is None or A_log.shape == (h,),
          lambda: f"ssd_decode_step: A_log must be ({h},), got {tuple(A_log.shape)}")  # type: ignore[union-attr]
    check(dt_bias is None or dt_bias.shape == (h,), lambda: f"ssd_decode_step: dt_bias must be ({h},)")
    check(not isinstance(D, Tensor) or D.shape in ((h,), (h, p)),
          lambda: f"ssd_decode_step: D must be ({h},) or ({h}, {p}), got {tuple(D.shape)}")  # type: ignore
    check(bc_order in ("BC", "CB"), lambda: f"ssd_decode_step: bc_order must be 'BC' or 'CB', got {bc_order!r}")
    check((z is None) == (norm_weight is None), lambda: "ssd_decode_step: the norm takes both z and norm_weight")
    check(z is None or (z.shape == (b, h * p) and z.stride(-1) == 1),
          lambda: f"ssd_decode_step: z must be {(b, h * p)} with contiguous channels, got "
                  f"{tuple(z.shape)}")  # type: ignore[union-attr]
    check(norm_weight is None or norm_weight.shape == (h * p,),
          lambda: f"ssd_decode_step: norm_weight must be ({h * p},)")
    norm = None if z is None or norm_weight is None else (z, norm_weight, float(eps), bool(norm_before_gate))
    return decode_unchecked(xbc, conv_state, conv_weight, conv_bias, state, dt, A_log, D, bc_order, dt_bias,
                            dt_softplus, (float(dt_limit[0]), float(dt_limit[1])), float(scale), silu, norm, backend)


def decode_unchecked(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None, state: Tensor,
                     dt: Tensor | None, A_log: Tensor | None, D: Tensor | float | None, bc_order: str,
                     dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float], scale: float,
                     silu: bool, norm: tuple[Tensor, Tensor, float, bool] | None, backend: str | None) -> Tensor:
    """:func:`ssd_decode_step` without its argument checks, every argument positional (``dt_limit`` and ``scale``
    floats; ``conv_weight`` also as nn.Conv1d's depthwise (channels, 1, kernel); ``norm``: ``(z, norm_weight, eps,
    norm_before_gate)`` or None): for callers whose arguments are right by construction, a block's one-token step,
    where the checks would be a large part of the step's time."""
    name = DECODE.choose(backend, xbc.device, state=state, dt=dt, conv_weight=conv_weight,
                         others=(xbc, conv_state, conv_bias, A_log, dt_bias, D, *(norm[:2] if norm else ())))
    if name == "native":
        return decode_native(xbc, conv_state, conv_weight, conv_bias, state, dt, A_log, D, bc_order == "CB",
                             dt_bias, dt_softplus, dt_limit, scale, silu, norm)
    # the other forms normalize with the norm op: its backend (the one named in the call, or its own automatic
    # choice) is chosen before the step updates the states, so a refusal leaves them as they were
    norm_name = None if norm is None else NORM.choose(backend, xbc.device, y=norm[0], z=norm[0], weight=norm[1])
    conv_weight = conv_weight.flatten(1)
    if name == "triton":
        from .triton_kernels import ssd_decode_step_triton

        y = ssd_decode_step_triton(xbc, conv_state, conv_weight, conv_bias, state, dt, A_log, D,
                                   bc_order=bc_order, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                   scale=scale, silu=silu)
    else:
        form = decode_reference if name == "reference" else decode_torch
        groups = (xbc.shape[1] - state.shape[1] * state.shape[2]) // (2 * state.shape[3])
        y = form(xbc, conv_state, conv_weight, conv_bias, state, dt, A_log, D, groups=groups, bc_order=bc_order,
                 dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, scale=scale, silu=silu)
    return y if norm is None or norm_name is None else norm_by_name(norm_name, y, *norm)
