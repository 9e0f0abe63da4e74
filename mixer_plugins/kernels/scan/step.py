"""The SSD recurrence for one or a few tokens, given a state: the decoding step of a causal scan.

Per head ``h`` (group ``g = h // (heads / groups)``) and token ``t``::

    state <- exp(A_h dt_{t,h}) state + dt_{t,h} x_{t,h} B_{t,g}^T        (head_dim x d_state)
    y_{t,h} = state C_{t,g} (+ D_h x_{t,h})

the same recurrence :func:`~mixer_plugins.kernels.ssd` evaluates in chunks over a whole sequence (with
``initial_states`` and ``return_final_states=True`` it is the parallel prefill of this step). Plain PyTorch on any
device; a loop over the (few) tokens, each a handful of batched elementwise products and one contraction, with no
value-dependent control flow (the shapes alone decide what runs), so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check

__all__ = ["ssd_step"]


def ssd_step(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor, *,
             D: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Advance an SSD state over ``x``'s tokens: returns ``(y, new_state)``; ``state`` itself is not modified.

    Shapes follow :func:`~mixer_plugins.kernels.ssd`: x (b, t, h, p), dt (b, t, h) (already positive: softplus and
    clamps applied), A (h,), B and C (b, t, g, n), state (b, h, p, n), D (h,) or (h, p). ``y`` is (b, t, h, p) in
    x's dtype; the state keeps ``state``'s dtype (accumulate in float32 or float64 for low-precision inputs).
    """
    check(x.dim() == 4, f"ssd_step: x must be (batch, tokens, heads, head_dim), got shape {tuple(x.shape)}")
    b, t, h, p = x.shape
    check(tuple(dt.shape) == (b, t, h), f"ssd_step: dt must be {(b, t, h)}, got {tuple(dt.shape)}")
    check(tuple(A.shape) == (h,), f"ssd_step: A must be ({h},), got {tuple(A.shape)}")
    check(B.dim() == 4 and B.shape[:2] == (b, t) and B.shape == C.shape,
          f"ssd_step: B and C must be (batch, tokens, groups, d_state) of one shape, got {tuple(B.shape)} and "
          f"{tuple(C.shape)}")
    g, n = B.shape[2], B.shape[3]
    check(h % g == 0, f"ssd_step: heads ({h}) must be a multiple of groups ({g})")
    check(tuple(state.shape) == (b, h, p, n), f"ssd_step: state must be {(b, h, p, n)}, got {tuple(state.shape)}")
    if D is not None:
        check(tuple(D.shape) in ((h,), (h, p)), f"ssd_step: D must be ({h},) or ({h}, {p}), got {tuple(D.shape)}")
    rep = h // g
    work = state.dtype
    Bh = B.repeat_interleave(rep, dim=2).to(work) if rep > 1 else B.to(work)     # (b, t, h, n)
    Ch = C.repeat_interleave(rep, dim=2).to(work) if rep > 1 else C.to(work)
    dtw = dt.to(work)
    decay = (dtw * A.to(work)).exp()                                            # (b, t, h)
    xw = x.to(work)
    ys = []
    for i in range(t):
        update = (dtw[:, i, :, None] * xw[:, i])[..., None] * Bh[:, i, :, None, :]    # (b, h, p, n)
        state = state * decay[:, i, :, None, None] + update
        ys.append((state * Ch[:, i, :, None, :]).sum(-1))                          # (b, h, p)
    y = torch.stack(ys, dim=1)
    if D is not None:
        skip = D.to(work)[:, None] if D.dim() == 1 else D.to(work)
        y = y + skip * xw
    return y.to(x.dtype), state
