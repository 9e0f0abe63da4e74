"""``local_attention``: sliding-window softmax attention, optionally with global tokens, on the sequence axis.

Per head, query ``i`` may attend key ``j`` when

    |i - j| <= window   or   i < num_global   or   j < num_global        (the band, plus global tokens)

and, when ``causal``, ``j <= i`` (so causal + window keeps ``i - window <= j <= i``: ``window + 1`` keys); pad keys
(right padding, ``mask`` False) are excluded. Then ``softmax_j(scale * q_i . k_j)`` over the allowed keys, times
``v``. The first ``num_global`` tokens are global as in Longformer: every query sees them and they see every key.

Forms (:data:`LOCAL` names them and the automatic order):

* ``torch`` (the default off CUDA): blocked, ``O(L * window)`` time and memory: queries in chunks of ``window``
  tokens, each chunk scoring only the keys of its neighbour chunks (and the global keys); global queries are dense
  rows. A ``torch.library`` custom op (:data:`local_attention_blocked`), so ``torch.compile(fullgraph=True)`` keeps
  it whole and ``FlopCounterMode`` counts the executed pairs (:func:`local_attention_flops`).
* ``triton`` (chosen first on CUDA, float32/bfloat16/float16): the fused MLR attention kernel
  (:mod:`mixer_plugins.kernels.mlr_attention.triton_kernels`) with one global level of rank = head dim and a band: a
  key tile entirely outside a query tile's band that holds no global token is never visited (the tile loops start and
  stop at the band), a per-entry mask cuts the band inside the visited tiles. Forward and backward.
* ``reference``: the dense ``L x L`` masked softmax, float64-capable, the independent oracle.
"""

from __future__ import annotations

import math

import torch as _torch  # plain ``torch`` would be shadowed by this package's ``torch`` submodule
from torch import Tensor

from .._checks import check_qkv, check_right_padded_mask
from .._dispatch import Op, row_span
from .._requirements import triton_attention_unavailable
from .reference import local_attention_reference
from .torch import LocalPlan, local_attention_blocked, local_attention_flops, local_attention_torch

__all__ = [
    "LOCAL",
    "LocalPlan",
    "check_local_arguments",
    "local_attention",
    "local_attention_blocked",
    "local_attention_flops",
    "local_attention_reference",
    "local_attention_torch",
]


def _why_not(backend: str, device: _torch.device, *, q: Tensor | None = None, span: int = 0) -> str | None:
    """Why ``backend`` cannot run attention on ``q`` (``None`` when it can); ``span``: the largest offset within a
    batch's slice of the inputs (:func:`.._dispatch.row_span`)."""
    if backend == "triton":
        return triton_attention_unavailable(device, None if q is None else q.dtype, span)
    return None


#: The attention's forms, and the automatic order per device type (the first that can run the call runs it).
LOCAL = Op("local_attention", backends=("reference", "torch", "triton"), automatic={"cuda": ("triton", "torch")},
           why_not=_why_not)


def check_local_arguments(q: Tensor, k: Tensor, v: Tensor, window: int, num_global: int, mask: Tensor | None,
                          scale: float | None) -> tuple[int, int, float]:
    """Validate the arguments of :func:`local_attention`; returns (window, num_global, scale)."""
    check_qkv(q, k, v)
    if isinstance(window, bool) or int(window) != window or window < 0:
        raise ValueError(f"window must be a non-negative integer, got {window!r}")
    length = q.shape[1]
    if isinstance(num_global, bool) or int(num_global) != num_global or not 0 <= num_global <= length:
        raise ValueError(f"num_global must be an integer in [0, length={length}], got {num_global!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    check_right_padded_mask(mask, q)
    return int(window), int(num_global), float(scale)


def local_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool = False,
                    mask: Tensor | None = None, scale: float | None = None, num_global: int = 0,
                    backend: str | None = None) -> Tensor:
    """Sliding-window softmax attention with optional global tokens (see the module docstring).

    Args:
        q, k: (batch, length, heads, e).
        v: (batch, length, heads, p).
        window: keys within this distance are attended (``>= length``: plain attention).
        causal: key ``j`` is allowed for query ``i`` only if ``j <= i``.
        mask: optional bool (batch, length), True on real tokens, right-padded. Pad keys are excluded and pad
            contents never reach real outputs (selected away, so NaN pads are harmless); outputs at pads are 0.
        scale: logit scale (default ``1 / sqrt(e)``).
        num_global: the first ``num_global`` tokens attend and are attended by every token (causal mask aside).
        backend: ``"torch"``, ``"triton"``, ``"reference"``; None = automatic (triton, then torch, on CUDA).

    Returns:
        (batch, length, heads, p) in v's dtype.

    Note: a non-finite value at a real *future* key still reaches a causal row through ``0 * inf`` in the
    ``torch``/``triton`` matmuls; the mixers guard against that before calling (as for the other fused paths).
    """
    window, num_global, scale = check_local_arguments(q, k, v, window, num_global, mask, scale)
    if mask is not None:
        real = mask[:, :, None, None]
        zero = _torch.zeros((), dtype=q.dtype, device=q.device)
        q, k, v = (_torch.where(real, t, zero) for t in (q, k, v))  # select: NaN in pads never propagates
    # the span lets the triton backend refuse rows past its 32-bit offsets, eager or compiled
    name = LOCAL.choose(backend, q.device, q=q, span=row_span(q, k, v))
    if name == "triton":
        from .triton import local_attention_triton

        form = local_attention_triton
    else:
        form = local_attention_reference if name == "reference" else local_attention_torch  # type: ignore[assignment]
    out = form(q, k, v, window=window, causal=causal, mask=mask, scale=scale, num_global=num_global)
    if mask is not None:
        out = _torch.where(mask[:, :, None, None], out, _torch.zeros((), dtype=out.dtype, device=out.device))
    return out

