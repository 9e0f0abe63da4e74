"""``triton`` backend of :func:`..mlr_attention`: our fused kernels (:mod:`.triton_kernels`): flash-style, each tile
pair's scores one dot of the width of the levels it shares (a per-entry mask only where a block boundary, the causal
diagonal or the partial last tile crosses the pair). Loaded on first use; chosen first on CUDA for float32, bfloat16
and float16 (float64 goes to the ``torch`` backend)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_attention_unavailable


def impl(q: Tensor, k: Tensor, v: Tensor, *, ranks: Sequence[int], block_sizes: Sequence[Optional[int]],
         scales: Sequence[float], causal: bool = False, mask: Tensor | None = None,
         block_divide: bool = True) -> Tensor:
    from .triton_kernels import mlr_attention_triton

    if mask is not None:  # select the pads away: NaN there must reach no real output or gradient
        real = mask[:, :, None, None]
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        q, k, v = (torch.where(real, t, zero) for t in (q, k, v))
    out = mlr_attention_triton(q, k, v, ranks, block_sizes, scales, block_divide=block_divide, causal=causal,
                               mask=mask)
    if mask is not None:  # the op's contract: pad outputs are 0
        out = torch.where(mask[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


BACKEND = register(Backend(op="mlr_attention", name="triton", impl=impl, priority=40,
                           check=triton_attention_unavailable,
                           automatic_devices=("cuda",)))
