"""``mlr_attention``: Multi-Level Low-Rank (MLR) softmax attention on the sequence axis (Kuang et al. 2025).

For each head, queries and keys are the concatenation of ``L`` levels of widths ``ranks`` (``r_0, ..., r_{n-1}``,
level 0 first: the mixer's head dim split in order). Level ``l`` cuts the sequence into contiguous blocks of
``block_sizes[l]`` tokens aligned at position 0 (``None``: one global block; the last block may be partial) and
scores only pairs inside a block::

    S(i, j) = sum_l [i, j share a level-l block] * scales[l] * q_i^(l) . k_j^(l)
              / (number of levels whose block holds both i and j   if block_divide else 1)

(a pair sharing no level scores 0); then the causal mask (optional), pad keys excluded, softmax over keys, times
``v``. Blocks must nest: each size divides the previous one, global levels come first.

Forms (:data:`MLR` names them and the automatic order): ``torch`` (tiled, flash-style, memory linear in the length,
batched matmuls per task, :mod:`.chunked`), ``native`` (the same tiling in our fused C++ kernel, :mod:`.native`; the
CPU default for float32 and float64) — both run inside one ``torch.library`` custom op, :func:`mlr_attention_tiled`,
so ``torch.compile`` keeps it whole (an export traces the reference) and ``FlopCounterMode`` counts it with
:func:`mlr_attention_flops`; ``reference`` (the materialized ``L x L`` oracle, float64-capable); ``triton`` (our
fused kernel, :mod:`.triton_kernels`; CUDA, chosen first there for float32, bfloat16 and float16: it computes in
float32 at most, so it refuses float64 inputs and the ``torch`` backend runs them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch as _torch  # plain ``torch`` would be shadowed by this package's ``torch`` submodule
from torch import Tensor

from .._checks import check_qkv, check_right_padded_mask
from .._dispatch import Op, row_span
from .._native_check import native_unavailable
from .._requirements import triton_attention_unavailable
from . import native
from .reference import mlr_attention_reference
from .torch import mlr_attention_tiled, mlr_attention_torch, paper_flops, plan_tasks

__all__ = [
    "MLR",
    "check_mlr_arguments",
    "mlr_attention",
    "mlr_attention_flops",
    "mlr_attention_reference",
    "mlr_attention_tiled",
    "mlr_attention_torch",
    "plan_tasks",
]


def _why_not(backend: str, device: _torch.device, *, q: Tensor | None = None, span: int = 0) -> str | None:
    """Why ``backend`` cannot run attention on ``q`` (``None`` when it can); ``span``: the largest offset within a
    batch's slice of the inputs (:func:`.._dispatch.row_span`)."""
    if backend == "native":
        if _torch.compiler.is_compiling() and q is not None:  # a compiled graph keeps the op: only if already loaded
            usable = device.type == "cpu" and q.dtype in (_torch.float32, _torch.float64) and native.is_loaded()
            return None if usable else "the native engine is compiled into a graph only once loaded, in float32/64"
        return native_unavailable(device, [] if q is None else [q])
    if backend == "triton":
        return triton_attention_unavailable(device, None if q is None else q.dtype, span)
    return None


#: The attention's forms, and the automatic order per device type (the first that can run the call runs it).
MLR = Op("mlr_attention", backends=("reference", "torch", "native", "triton"),
         automatic={"cuda": ("triton", "torch"), "cpu": ("native", "torch")}, why_not=_why_not)


def check_mlr_arguments(q: Tensor, k: Tensor, v: Tensor, ranks: Sequence[int],
                        block_sizes: Sequence[Optional[int]], scales: Sequence[float] | None,
                        mask: Tensor | None) -> tuple[list[int], list[Optional[int]], list[float]]:
    """Validate the arguments of :func:`mlr_attention`; returns (ranks, block_sizes, scales) as lists."""
    check_qkv(q, k, v)
    ranks = [int(r) for r in ranks]
    if not ranks or any(r <= 0 for r in ranks):
        raise ValueError(f"ranks must be a non-empty list of positive integers, got {ranks}")
    if sum(ranks) != q.shape[-1]:
        raise ValueError(f"ranks {ranks} sum to {sum(ranks)}, but q and k have width {q.shape[-1]}")
    sizes = list(block_sizes)
    if len(sizes) != len(ranks):
        raise ValueError(f"block_sizes has {len(sizes)} entries but ranks has {len(ranks)} (one per level)")
    for level, size in enumerate(sizes):
        if size is not None and (int(size) != size or size <= 0):
            raise ValueError(f"block_sizes[{level}] = {size}; block sizes must be positive integers or None")
        prev = sizes[level - 1] if level else None
        if level and prev is not None and size is None:
            raise ValueError(f"block_sizes[{level}] is None (global) after a level with blocks of {prev}: "
                             "global levels must come first (blocks must nest)")
        if prev is not None and size is not None and prev % size:
            raise ValueError(f"block_sizes must nest: {size} (level {level}) does not divide {prev} "
                             f"(level {level - 1})")
    if scales is None:
        scales = [1.0 / r for r in ranks]
    scales = [float(s) for s in scales]
    if len(scales) != len(ranks):
        raise ValueError(f"scales has {len(scales)} entries but ranks has {len(ranks)} (one per level)")
    check_right_padded_mask(mask, q)
    return ranks, [None if s is None else int(s) for s in sizes], scales


def mlr_attention(q: Tensor, k: Tensor, v: Tensor, *, ranks: Sequence[int], block_sizes: Sequence[Optional[int]],
                  scales: Sequence[float] | None = None, causal: bool = False, mask: Tensor | None = None,
                  block_divide: bool = True, backend: str | None = None) -> Tensor:
    """MLR softmax attention (see the module docstring).

    Args:
        q, k: (batch, length, heads, sum(ranks)): the levels concatenated along the last axis, level 0 first.
        v: (batch, length, heads, value width).
        ranks: width ``r_l`` of each level.
        block_sizes: tokens per block of each level, ``None`` = global; blocks nest (each divides the previous).
        scales: logit scale of each level (default ``1 / r_l``, the paper's muP); any division by the number of
            levels is the caller's (the mixer passes its ``level_scales``).
        causal: key ``j`` is allowed for query ``i`` only if ``j <= i``.
        mask: optional bool (batch, length), True on real tokens, right-padded. Pad keys are excluded and pad
            values never reach real outputs (they are selected away, so NaN pads are harmless); outputs at pad
            queries are 0.
        block_divide: divide each score by the number of levels whose block holds both tokens.
        backend: ``"torch"``, ``"native"``, ``"triton"``, ``"reference"``; None = automatic.

    Returns:
        (batch, length, heads, value width).
    """
    ranks, sizes, scales = check_mlr_arguments(q, k, v, ranks, block_sizes, scales, mask)
    # the span lets the triton backend refuse rows past its 32-bit offsets, eager or compiled
    name = MLR.choose(backend, q.device, q=q, span=row_span(q, k, v))
    if name == "reference":
        return mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=sizes, scales=scales, causal=causal,
                                       mask=mask, block_divide=block_divide)
    if name != "triton":
        return mlr_attention_torch(q, k, v, ranks=ranks, block_sizes=sizes, scales=scales, causal=causal, mask=mask,
                                   block_divide=block_divide, engine="native" if name == "native" else "matmul")
    from .triton_kernels import mlr_attention_triton

    if mask is not None:  # select the pads away: NaN there must reach no real output or gradient
        real = mask[:, :, None, None]
        zero = _torch.zeros((), dtype=q.dtype, device=q.device)
        q, k, v = (_torch.where(real, t, zero) for t in (q, k, v))
    out = mlr_attention_triton(q, k, v, ranks, sizes, scales, block_divide=block_divide, causal=causal, mask=mask)
    if mask is not None:  # the op's contract: pad outputs are 0
        out = _torch.where(mask[:, :, None, None], out, _torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def mlr_attention_flops(batch: int, heads: int, length: int, *, ranks: Sequence[int],
                        block_sizes: Sequence[Optional[int]], value_width: int, causal: bool = False,
                        executed: bool = False) -> dict[str, int]:
    """Forward FLOPs (2 per multiply-add) of :func:`mlr_attention`: ``{"scores": ..., "weighted_values": ...}``.

    By default the count ``FlopCounterMode`` reports for the op (its registered formula) and the ``mlr_attention``
    mixer's ``flops``: the math of the definition, as attention kernels are counted (useful FLOPs, not padding).
    Each (query, key) pair of the ``L x L`` matrix costs the features of the levels whose block holds both, plus
    ``value_width`` for ``A V``; causal masking is not subtracted (PyTorch's SDPA formula does not either).

    ``executed=True``: what the ``torch`` backend (the ``matmul`` engine) actually multiplies: every task's full
    rectangle (with ``causal``, only the tasks the mask keeps), each pair at the width of the levels it shares,
    ``r_0 + ... + r_m``, and ``value_width`` for its value.
    """
    if not isinstance(executed, bool):
        raise TypeError(f"executed must be True or False, got {executed!r}")
    if not executed:
        return paper_flops(batch, heads, length, list(ranks), list(block_sizes), value_width)
    plan = plan_tasks(length, list(ranks), list(block_sizes), causal=causal, block_divide=True, dyadic=True)
    scores = values = 0
    for group in plan.groups:
        for task in group.tasks:
            pairs = task.count * task.q_len * task.k_len
            scores += pairs * group.width
            values += pairs * value_width
    return {"scores": 2 * batch * heads * scores, "weighted_values": 2 * batch * heads * values}

