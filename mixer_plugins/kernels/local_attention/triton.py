"""``triton`` form of :func:`..local_attention`: the fused MLR attention kernels
(:mod:`..mlr_attention.triton_kernels`) with one global level of rank = head dim and a band (see the package)."""

from __future__ import annotations

from torch import Tensor


def local_attention_triton(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool = False,
                           mask: Tensor | None = None, scale: float, num_global: int = 0,
                           tile_size: int | None = None) -> Tensor:
    """Windowed attention on the MLR kernels; arguments as :func:`mixer_plugins.kernels.local_attention` (inputs
    finite: the op selects the pads away). Differentiable in q, k and v. Returns v's dtype (pad outputs not zeroed:
    the op does that). ``tile_size``: square tiles of that many tokens for every kernel (None: the kernels'
    defaults; the interpreter tests use tiny tiles)."""
    from ..mlr_attention.triton_kernels import MLRSpec, Tiles, mlr_triton

    spec = MLRSpec(ranks=(q.shape[-1],), sizes=(0,), taus=(float(scale),), block_divide=False, causal=bool(causal),
                   window=int(window), num_global=int(num_global))
    return mlr_triton(q, k, v, spec, mask=mask, tiles=Tiles.uniform(tile_size))
