"""``triton`` backend of :func:`..mlr_attention`: our fused kernel (:mod:`.._triton.mlr`), flash-style with an
online softmax over the levels each (query tile, key tile) pair shares. Loaded on first use; chosen first on CUDA."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from torch import Tensor

from .._dispatch import Backend, register
from .._requirements import triton_unavailable


def impl(q: Tensor, k: Tensor, v: Tensor, *, ranks: Sequence[int], block_sizes: Sequence[Optional[int]],
         scales: Sequence[float], causal: bool = False, mask: Tensor | None = None,
         block_divide: bool = True) -> Tensor:
    from .._triton.mlr import mlr_attention_triton

    out = mlr_attention_triton(q, k, v, ranks, block_sizes, scales, block_divide=block_divide, causal=causal,
                               mask=mask)
    if mask is not None:  # the op's contract: pad outputs are 0 (selected, so nothing at a pad can leak)
        out = out.masked_fill(~mask[:, :, None, None], 0)
    return out


BACKEND = register(Backend(op="mlr_attention", name="triton", impl=impl, priority=40, check=triton_unavailable,
                           automatic_devices=("cuda",)))
