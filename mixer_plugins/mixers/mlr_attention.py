"""``mlr_attention``: Multi-Level Low-Rank (MLR) softmax attention on the sequence axis (Kuang et al. 2025).

Queries and keys (per head, after QK-LN) are split along the head dim into levels of widths ``r_0, ..., r_{L-1}``.
Level ``l`` cuts the sequence into contiguous blocks of ``s_l`` tokens aligned at position 0 and scores only pairs
inside a block::

    S(i, j) = sum_l [i, j in the same level-l block] * tau_l * q_i^(l) . k_j^(l),      tau_l = 1 / r_l (muP, default)

divided, with ``block_divide``, by the number of levels whose block holds both tokens. Blocks are a fixed number of
tokens (the last, partial block is a block), so the mixer runs at any length and is padding-invariant.

The forward runs the tiled op :func:`mixer_plugins.kernels.mlr_attention` (memory linear in the length). With
``attn_dropout > 0`` in training mode, or ``link_function="identity"``, it falls back to the materialized path
(:meth:`MLRAttention.scores`: block by block into one dense ``L x L`` per head, then the link, dropout and ``A V``).
Decoding (causal) keeps every token's keys and values; a step scores each level only over the slots in the query's
own block.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from functools import reduce
from typing import Any, Literal, Optional

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ..kernels import mlr_attention
from ..kernels.mlr_attention.reference import same_block_mask
from ..registry.spec import MixerSpec
from ._softmax_common import (
    AttentionLinkOptions,
    LevelRanksConfig,
    QKVSoftmaxConfig,
    QKVSoftmaxMixer,
    StructuredSoftmaxMixer,
    attention_weights,
    dot_scores,
)
from .base import QKContext
from .cache import MixerCache, append_kv

__all__ = ["MLRAttention", "MLRAttentionConfig", "SPEC", "mlr_level_counts", "same_block_mask"]


class MLRAttentionConfig(QKVSoftmaxConfig, LevelRanksConfig, AttentionLinkOptions):
    """Options of MLR attention (levels on the sequence axis)."""

    block_sizes: Optional[list[Optional[int]]] = Field(
        None,
        description="tokens per block of each level (None = one global block); each must divide the previous "
        "one. Default: level 0 global, then halving down to min_block_size at the last level",
    )
    min_block_size: int = Field(8, gt=0, description="block size of the last level in the default block_sizes")
    block_divide: bool = Field(
        True, description="divide each score by the number of levels whose block holds both tokens"
    )
    divide_by_levels: bool = Field(False, description="divide every score by the number of levels")
    logit_scaling: Literal["standard", "mup"] = Field(
        "mup", description="per-level scale: 'mup' = multiplier/r_l (the paper: 1/r_l), 'standard' = "
        "multiplier/sqrt(r_l)",
    )

    @model_validator(mode="after")
    def _check_levels(self) -> MLRAttentionConfig:
        ranks = self.resolved_ranks()
        if self.block_sizes is not None:
            sizes = self.block_sizes
            if len(sizes) != len(ranks):
                raise ValueError(f"block_sizes has {len(sizes)} entries but there are {len(ranks)} levels (ranks)")
            for level, size in enumerate(sizes):
                if size is not None and size <= 0:
                    raise ValueError(f"block_sizes[{level}] = {size}; block sizes must be positive (or None = global)")
                prev = sizes[level - 1] if level else None
                if level and prev is not None and size is None:
                    raise ValueError(
                        f"block_sizes[{level}] is None (global) but level {level - 1} has blocks of {prev}; "
                        "global levels must come first (blocks must nest)"
                    )
                if prev is not None and size is not None and prev % size:
                    raise ValueError(
                        f"block_sizes must nest: {size} (level {level}) does not divide {prev} (level {level - 1})"
                    )
        return self

    def resolved_block_sizes(self) -> list[Optional[int]]:
        """Tokens per block of each level (None = global), the default when ``block_sizes`` is None."""
        if self.block_sizes is not None:
            return list(self.block_sizes)
        levels = len(self.resolved_ranks())
        return [None] + [self.min_block_size * 2 ** (levels - 1 - level) for level in range(1, levels)]


def mlr_level_counts(length: int, block_sizes: list[Optional[int]], device: torch.device | None = None) -> Tensor:
    """(L, L) int: number of levels whose block holds both tokens (the block-divide denominator)."""
    counts = torch.zeros(length, length, dtype=torch.long, device=device)
    for size in block_sizes:
        counts += same_block_mask(length, size, device)
    return counts


def _inverse_counts(size: int, block_sizes: Sequence[Optional[int]], coarser: int, device: torch.device,
                    dtype: torch.dtype) -> Tensor:
    """(size, size): ``coarser / (coarser + number of levels in block_sizes sharing a block)``, for a segment of
    ``size`` tokens aligned with every block. Rescales a running mean over ``coarser`` levels to the pair's count.

    Built per call on the scores' device, never cached at module level: a cached tensor outlives the call that made
    it, and one made while ``torch.export`` traces is a FakeTensor that would corrupt every later eager forward."""
    counts = mlr_level_counts(size, list(block_sizes), device).double()
    return (coarser / (coarser + counts)).to(dtype)


def _diagonal_regions(scores: Tensor, size: int) -> list[Tensor]:
    """Views of the diagonal blocks of ``size`` tokens of ``scores`` (B, h, m, m): the full blocks as (B, h, s, s, n)
    and the last partial block as (B, h, rem, rem)."""
    full, rem = divmod(scores.shape[-1], size)
    regions = []
    if full:
        span = full * size
        blocks = scores[:, :, :span, :span].unflatten(3, (full, size)).unflatten(2, (full, size))
        regions.append(blocks.diagonal(dim1=2, dim2=4))
    if rem:
        regions.append(scores[:, :, full * size:, full * size:])
    return regions


def _merge_blocks_(scores: Tensor, size: int, keeps: Sequence[Tensor | None], subs: Sequence[Tensor]) -> Tensor:
    """``scores[B] = keep * scores[B] + sub[B]`` on every diagonal block ``B`` of ``size`` tokens, in place."""
    for region, keep, sub in zip(_diagonal_regions(scores, size), keeps, subs):
        if keep is not None:
            region.mul_(keep)
        region.add_(sub)
    return scores


class _MergeBlocks(torch.autograd.Function):
    """``scores[B] = keep * scores[B] + sub[B]`` on every diagonal block ``B`` of ``size`` tokens, in place.

    ``scores`` (B, h, m, m) is a fresh intermediate (a matmul output or zeros), so it is overwritten (``mark_dirty``)
    instead of copied. ``subs`` are the blocks' new scores, in the layout of :func:`_diagonal_regions`; ``keeps`` the
    matching rescale of the old values (None: 1). Written as a Function because autograd through views of the
    diagonal blocks would zero-fill and copy the whole L x L base once per level in the backward pass; here the
    backward reads the blocks of the incoming gradient and copies it once only when some ``keep`` is not 1.
    """

    @staticmethod
    def forward(ctx: Any, scores: Tensor, size: int, keeps: Sequence[Tensor | None], *subs: Tensor) -> Tensor:
        with torch.no_grad():
            _merge_blocks_(scores, size, keeps, subs)
        ctx.mark_dirty(scores)
        ctx.size, ctx.keeps = size, keeps
        return scores

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad_subs = [region.clone() for region in _diagonal_regions(grad, ctx.size)]
        grad_scores = grad
        if any(keep is not None for keep in ctx.keeps):
            grad_scores = grad.clone()
            for region, keep in zip(_diagonal_regions(grad_scores, ctx.size), ctx.keeps):
                if keep is not None:
                    region.mul_(keep)
        return (grad_scores, None, None, *grad_subs)


class MLRAttention(QKVSoftmaxMixer, StructuredSoftmaxMixer[QKContext]):
    """MLR attention: q/k/v projections, QK-LN, multi-level block-diagonal low-rank scores, softmax, ``proj``."""

    def __init__(self, config: MLRAttentionConfig):
        super().__init__(config)
        self.ranks = config.resolved_ranks()
        self.block_sizes = config.resolved_block_sizes()
        divide = len(self.ranks) if config.divide_by_levels else 1
        self.level_scales = [config.logit_scale(r) / divide for r in self.ranks]
        self.block_divide = config.block_divide

    def logits(self, ctx: QKContext) -> Tensor:
        """Pre-link (pre-softmax) scores, unmasked, (batch, heads, L, L): :meth:`scores`."""
        return self.scores(ctx)

    def _levels(self, t: Tensor) -> tuple[Tensor, ...]:
        return torch.split(t, self.ranks, dim=-1)

    def scores(self, ctx: QKContext) -> Tensor:
        """Pre-softmax scores, computed block by block (the fast path), (batch, heads, L, L).

        Levels whose block holds the whole sequence (``None``, or a size >= L: the same thing at this length) share
        one dense product. Each finer level is computed bottom-up on its own blocks (see :meth:`_segment_scores`)
        and merged into the diagonal blocks of the coarser result in place (:class:`_MergeBlocks`)."""
        length = ctx.q.shape[1]
        sizes = tuple(None if size is None or size >= length else size for size in self.block_sizes)
        num_global = sum(size is None for size in sizes)  # a prefix: blocks nest (validated)
        q_levels, k_levels = self._levels(ctx.q), self._levels(ctx.k)
        if num_global:
            divide = num_global if self.block_divide else 1
            q = torch.cat([q_levels[lv] * (self.level_scales[lv] / divide) for lv in range(num_global)], dim=-1)
            k = torch.cat(k_levels[:num_global], dim=-1)
            scores = dot_scores(q, k)
        else:
            b, _, h, _ = ctx.q.shape
            scores = ctx.q.new_zeros(b, h, length, length)  # pairs outside every block score 0
        if num_global < len(sizes):
            scores = self._add_blocks(scores, q_levels, k_levels, sizes, num_global)
        return scores

    def _add_blocks(self, scores: Tensor, q_levels: Sequence[Tensor | None], k_levels: Sequence[Tensor | None],
                    sizes: Sequence[int | None], level: int) -> Tensor:
        """Add, inside every level-``level`` block of ``scores`` (B, h, m, m), the scores of levels ``>= level``.

        ``scores`` holds levels ``< level``, already divided by ``level`` when ``block_divide``; it is updated in place
        and returned. The last, partial block is a block of its own.
        """
        batch, heads, m, _ = scores.shape
        size = sizes[level]
        assert size is not None, "the levels from `level` on have blocks"
        subs: list[Tensor] = []
        keeps: list[Tensor | None] = []
        for start, num, width in ((0, m // size, size), (m // size * size, 1, m % size)):
            if num == 0 or width == 0:
                continue

            def segments(levels: Sequence[Tensor | None], start: int = start, num: int = num,
                         width: int = width) -> list[Tensor | None]:
                # (B, num * width, h, r) -> (B * num, width, h, r): one entry per block
                return [None if t is None
                        else t[:, start:start + num * width].reshape(batch * num, width, heads, t.shape[-1])
                        for t in levels]

            q_seg = segments([None] * level + list(q_levels[level:]))
            k_seg = segments([None] * level + list(k_levels[level:]))
            sub = self._segment_scores(q_seg, k_seg, sizes, level)  # (B * num, h, width, width)
            keep = None
            if self.block_divide and level > 0:
                # a pair in this block is counted by the `level` coarser levels plus the finer ones it shares
                keep = _inverse_counts(width, sizes[level:], level, scores.device, scores.dtype)
            if width == size:
                sub = sub.view(batch, num, heads, width, width).permute(0, 2, 3, 4, 1)
                keep = keep[..., None] if keep is not None else None
            subs.append(sub)
            keeps.append(keep)
        if not torch.is_grad_enabled():  # inference: no backward to spare, merge in place directly
            return _merge_blocks_(scores, size, keeps, subs)
        return _MergeBlocks.apply(scores, size, keeps, *subs)

    def _segment_scores(self, q_seg: Sequence[Tensor | None], k_seg: Sequence[Tensor | None],
                        sizes: Sequence[int | None], level: int) -> Tensor:
        """Scores of levels ``>= level`` inside a batch of level-``level`` blocks, (blocks, h, width, width)."""
        divide = level + 1 if self.block_divide else 1
        q, k = q_seg[level], k_seg[level]
        assert q is not None and k is not None, "the levels from `level` on are given"
        scores = dot_scores(q * (self.level_scales[level] / divide), k)
        if level + 1 < len(sizes):
            scores = self._add_blocks(scores, q_seg, k_seg, sizes, level + 1)
        return scores

    def mix(self, ctx: QKContext) -> Tensor:
        if self.uses_tiled_op():
            return mlr_attention(ctx.q, ctx.k, ctx.values, ranks=self.ranks, block_sizes=self.block_sizes,
                                 scales=self.level_scales, causal=self.causal, mask=ctx.mask,
                                 block_divide=self.block_divide)
        return self.mix_materialized(ctx)

    def matrix(self, ctx: QKContext) -> Tensor:
        # The definition, level by level with dense masks (independent of the blocked fast path).
        length = ctx.q.shape[1]
        device = ctx.q.device
        scores = reduce(operator.add, (dot_scores(q, k) * scale * same_block_mask(length, size, device)
                                       for q, k, scale, size in zip(self._levels(ctx.q), self._levels(ctx.k),
                                                                    self.level_scales, self.block_sizes)))
        if self.block_divide:
            scores = scores / mlr_level_counts(length, self.block_sizes, device).clamp(min=1)
        return self.weights(scores, ctx.mask)

    def mix_step(self, ctx: QKContext, cache: MixerCache) -> Tensor:
        positions, allowed = append_kv(cache, ctx.k, ctx.values)
        slots = torch.arange(cache.max_len, device=positions.device)
        if ctx.q.shape[1] == 1:
            return self._mix_one_token(ctx.q, cache, positions, slots, allowed)
        return torch.cat([self._mix_one_token(ctx.q[:, i:i + 1], cache, positions[:, i:i + 1], slots,
                                              allowed[:, i:i + 1]) for i in range(ctx.q.shape[1])], dim=1)

    def _mix_one_token(self, q: Tensor, cache: MixerCache, positions: Tensor, slots: Tensor,
                       allowed: Tensor) -> Tensor:
        """One token's mixed values (``q``: (batch, 1, heads, e) at ``positions`` (batch, 1)): every level's dot
        products with the cached keys from one elementwise product, each level kept inside the query's own block."""
        products = cache.read("k", q.dtype) * q                                        # (b, max_len, heads, e)
        scores: Tensor | None = None
        counts: Tensor | int = 0
        for part, scale, size in zip(self._levels(products), self.level_scales, self.block_sizes):
            level = part.sum(-1) * scale                                               # (b, max_len, heads)
            if size is not None:
                same = slots // size == positions // size                            # (b, max_len)
                level = level * same[..., None]
                counts = counts + same
            else:
                counts = counts + 1
            scores = level if scores is None else scores + level
        assert scores is not None, "at least one level"
        if self.block_divide:
            scores = scores / torch.as_tensor(counts)[..., None].clamp(min=1)
        weights = attention_weights(scores.transpose(1, 2)[:, :, None], allowed[:, None], self.link_function)
        return torch.einsum("bhtj,bjhp->bthp", weights, cache.read("v", weights.dtype))

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        # per level, the (query, key) products per (batch, head): the sum over its blocks of size^2
        pairs = [length * length if size is None else (length // size) * size * size + (length % size) ** 2
                 for size in self.block_sizes]
        proj = self.projection_flops(batch, length)
        return {
            "qkv_proj": proj["qkv_proj"],
            "scores": 2 * batch * self.num_heads * sum(r * p for r, p in zip(self.ranks, pairs)),
            "weighted_values": 2 * batch * self.num_heads * length * length * self.head_dim,
            "out_proj": proj["out_proj"],
        }


SPEC = MixerSpec(
    name="mlr_attention",
    aliases=("multi_level_low_rank_attention",),
    config=MLRAttentionConfig,
    builder=MLRAttention,
    summary="softmax attention with multi-level block low-rank scores on the sequence axis (Kuang et al. 2025)",
    matrix_class="dense (softmax of a multi-level low-rank matrix)",
    direction="either",
    complexity="O(L^2) (scores O(L sum_l s_l r_l))",
    data_dependent="yes",
    stepping=True,
    # Ranks left to their default (the head dim split over 4 levels), so the options fit any dim divisible by 8.
    test_options={"num_heads": 2, "block_sizes": [None, 8, 4, 2]},
)
