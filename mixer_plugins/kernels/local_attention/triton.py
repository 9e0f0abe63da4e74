"""``triton`` backend of :func:`..local_attention`: the fused MLR attention kernel (:mod:`.._triton.mlr`) with one
global level of rank = head dim (plain attention) and a band: key tiles outside a query tile's band that hold no
global token are never visited; a per-entry mask cuts the band inside the visited tiles. Forward and backward
(flash-style, the row log-sum-exp kept). Loaded on first use; chosen first on CUDA for float32, bfloat16 and
float16 inputs (it accumulates in float32; float64 goes to the ``torch`` backend)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable

#: query/key tile of the kernel (tokens; rounded to a power of two, at least 16 on GPUs)
TILE_SIZE = 64


def local_attention_triton(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool = False,
                           mask: Tensor | None = None, scale: float, num_global: int = 0,
                           tile_size: int = TILE_SIZE) -> Tensor:
    """Windowed attention on the MLR kernel; arguments as :func:`mixer_plugins.kernels.local_attention` (inputs
    finite: the op selects the pads away). Differentiable in q, k and v. Returns v's dtype."""
    from .._triton.mlr import _Levels, _MLRFunction, available

    reason = available(q.device)
    if reason is not None:
        raise RuntimeError(f"triton local attention unavailable: {reason}")
    e = q.shape[-1]
    qs = (q.float() * scale).contiguous()
    keyok = None if mask is None else mask.to(torch.int8).contiguous()
    levels = _Levels(q, v, [e], [None], tile_size)
    return _MLRFunction.apply(qs, k.contiguous(), v.contiguous(), keyok, levels, causal, False, int(window),
                              int(num_global))


def _check(device: torch.device, args: Any = None) -> str | None:
    reason = triton_unavailable(device, args)
    if reason is None and args is not None and getattr(args, "dtype", None) == torch.float64:
        return "the kernel accumulates in float32; float64 inputs run on the torch backend"
    return reason


def impl(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool = False, mask: Tensor | None = None,
         scale: float, num_global: int = 0) -> Tensor:
    return local_attention_triton(q, k, v, window=window, causal=causal, mask=mask, scale=scale,
                                  num_global=num_global)


BACKEND = register(Backend(op="local_attention", name="triton", impl=impl, priority=40, check=_check,
                           automatic_devices=("cuda",)))
