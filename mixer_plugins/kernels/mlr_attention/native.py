"""The ``native`` engine of the tiled MLR op: our fused C++ CPU kernel (``kernels/_native/mlr_attention.cpp``,
compiled at install, loaded by :mod:`mixer_plugins.kernels._native`).

One pass over the (query tile, key range) pieces that share a level, each piece's scores from one BLAS product at
its own width ``r_0 + ... + r_m`` (no Python per task, unlike the ``matmul`` engine), a vectorized ``exp`` and an
online softmax; the backward recomputes the scores from the row log-sum-exp (flash attention's split-KV backward).
Memory is linear in the length; float32 and float64. q, k and v are read in place (any strides with a unit feature
stride: the mixer's views need no copy); the level scales are applied as each query tile is read, not by a pass over
q.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from .._native import is_loaded, load
from .._native_check import require_native

__all__ = ["TILES", "backward", "forward", "is_loaded", "load"]

#: (query rows, keys) per tile of the forward and of the backward (measured at L = 4096 on 2 cores: 256 x 512 and
#: 128 x 256 within 2% of the best; the score tile stays in the L2 cache)
TILES = {"forward": (256, 512), "backward": (128, 256)}


def _levels(ranks: Sequence[int], block_divide: bool) -> tuple[list[int], list[float]]:
    """Per level ``m``: the score width of the pairs sharing levels ``0..m``, and their divisor's inverse."""
    widths = list(itertools.accumulate(int(r) for r in ranks))
    return widths, [1.0 / (m + 1) if block_divide else 1.0 for m in range(len(ranks))]


def _feature_rows(t: Tensor) -> Tensor:
    """``t`` with a unit stride on its last axis (the kernel reads rows of features in place)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(q: Tensor, k: Tensor, v: Tensor, key_len: Optional[Tensor], ranks: Sequence[int],
            block_sizes: Sequence[int], taus: Sequence[float], causal: bool,
            block_divide: bool) -> tuple[Tensor, Tensor]:
    """Output (B, L, H, P) and row log-sum-exp (B, L, H) of MLR attention: q, k (B, L, H, D), v (B, L, H, P),
    float32 or float64 CPU tensors (any strides); ``taus`` the level scales (applied inside); ``key_len`` int64 (B,)
    (keys at and beyond it are excluded; None: none); ``block_sizes`` with 0 for a global level."""
    require_native()
    widths, scales = _levels(ranks, block_divide)
    tq, tk = TILES["forward"]
    return torch.ops.mixer_plugins_native.mlr_forward(
        _feature_rows(q), _feature_rows(k), _feature_rows(v), key_len, widths, [int(s) for s in block_sizes], scales,
        [float(t) for t in taus], causal, tq, tk)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_len: Optional[Tensor],
             ranks: Sequence[int], block_sizes: Sequence[int], taus: Sequence[float], causal: bool,
             block_divide: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of :func:`forward` given its output and log-sum-exp."""
    require_native()
    widths, scales = _levels(ranks, block_divide)
    tq, tk = TILES["backward"]
    return torch.ops.mixer_plugins_native.mlr_backward(
        _feature_rows(dout), _feature_rows(q), _feature_rows(k), _feature_rows(v), out.contiguous(), lse.contiguous(),
        key_len, widths, [int(s) for s in block_sizes], scales, [float(t) for t in taus], causal, tq, tk)
