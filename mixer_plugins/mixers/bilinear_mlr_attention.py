"""``bilinear_mlr_attention``: softmax attention whose bilinear form is Multi-Level Low-Rank on the **feature** axis
(Kuang et al. 2025, used for in-context regression).

Level ``l`` cuts the input ``x`` (width ``D``) into ``p_l`` contiguous chunks (default ``p_l = 2^l``) and maps chunk
``k`` with its own ``W_Q^(l)[k], W_K^(l)[k]`` of shape ``(D/p_l) x (H r_l)``. Per head, the level's query is the
concatenation over chunks (width ``r_l p_l``, layout ``rho * p_l + k``), LayerNorm'd over that width (one LN per level,
shared by heads), and::

    score_h(i, j) = sum_l tau_l * q_h^(l)(i) . k_h^(l)(j),       tau_l = 1/sqrt(r_l p_l)  (or multiplier/(r_l p_l))

Without the LN, the per-head bilinear matrix is an MLR matrix of rank up to ``sum_l r_l p_l`` for the parameters of
dense ``W_Q, W_K``. The sequence axis is untouched: ordinary (optionally causal) softmax over keys, dense values, output
projection. Decoding (causal) keeps every token's keys (all levels side by side) and values.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from functools import reduce
from typing import Optional

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from ..layers.mup import rms_cap
from ..registry.spec import MixerSpec
from ._softmax_common import AttentionLinkOptions, LevelRanksConfig, QKNormOptions, StructuredSoftmaxMixer, dot_scores
from .base import MixerContext

__all__ = ["BilinearMLRAttention", "BilinearMLRAttentionConfig", "LevelsContext", "SPEC"]


@dataclasses.dataclass(eq=False, kw_only=True)
class LevelsContext(MixerContext):
    """Per level, the per-head queries and keys (batch, length, heads, r_l * p_l)."""

    q_levels: list[Tensor]
    k_levels: list[Tensor]


class BilinearMLRAttentionConfig(LevelRanksConfig, AttentionLinkOptions, QKNormOptions):
    """Options of Bilinear-MLR attention (levels on the feature axis)."""

    num_blocks: Optional[list[int]] = Field(
        None, description="feature chunks p_l of each level (each must divide dim); default 2^l"
    )
    divide_by_levels: bool = Field(False, description="divide every score by the number of levels")
    rms_cap: bool = Field(True, description="cap the RMS of the level weights in the forward pass (see muP docs)")

    @model_validator(mode="after")
    def _check_levels(self) -> BilinearMLRAttentionConfig:
        levels = len(self.resolved_ranks())
        blocks = self.resolved_num_blocks()
        if len(blocks) != levels:
            raise ValueError(f"num_blocks has {len(blocks)} entries but there are {levels} levels (ranks)")
        for level, p in enumerate(blocks):
            if p <= 0 or self.dim % p:
                raise ValueError(
                    f"num_blocks[{level}] = {p} must be a positive divisor of dim={self.dim} "
                    f"(level {level} cuts the features into {p} equal chunks)"
                )
        return self

    def resolved_num_blocks(self) -> list[int]:
        """Feature chunks of each level (``2^l`` unless ``num_blocks`` is set)."""
        if self.num_blocks is not None:
            return list(self.num_blocks)
        return [2**level for level in range(len(self.resolved_ranks()))]


class BilinearMLRAttention(StructuredSoftmaxMixer[LevelsContext]):
    """Bilinear-MLR attention: per-level block-diagonal q/k maps ``q_weight_<l>``/``k_weight_<l>`` of shape
    ``(p_l, D/p_l, H r_l)``, per-level LNs, softmax, dense ``value`` and ``proj``."""

    def __init__(self, config: BilinearMLRAttentionConfig):
        super().__init__(config)
        dim = config.dim
        self.ranks = config.resolved_ranks()
        self.num_blocks = config.resolved_num_blocks()
        self.key_width = sum(r * p for r, p in zip(self.ranks, self.num_blocks))
        self.rms_cap = config.rms_cap
        divide = len(self.ranks) if config.divide_by_levels else 1
        self.level_scales = [config.logit_scale(r * p) / divide for r, p in zip(self.ranks, self.num_blocks)]
        self.mup_fan_in: dict[str, int] = {}
        self.q_norms: nn.ModuleList | None = nn.ModuleList() if config.qk_norm else None
        self.k_norms: nn.ModuleList | None = nn.ModuleList() if config.qk_norm else None
        for level, (r, p) in enumerate(zip(self.ranks, self.num_blocks)):
            fan_in = dim // p
            for side in ("q", "k"):
                weight = nn.Parameter(torch.randn(p, fan_in, self.num_heads * r) / math.sqrt(fan_in))
                self.register_parameter(f"{side}_weight_{level}", weight)
                self.mup_fan_in[f"{side}_weight_{level}"] = fan_in
            if self.q_norms is not None and self.k_norms is not None:  # qk_norm
                self.q_norms.append(nn.LayerNorm(r * p, bias=config.ln_bias))
                self.k_norms.append(nn.LayerNorm(r * p, bias=config.ln_bias))
        self.value = nn.Linear(dim, dim, bias=config.proj_bias)
        self.proj = nn.Linear(dim, dim, bias=config.proj_bias)
        # muP zero-initialises the query (logits exactly 0 at init); behind the LNs, that is their gains.
        if config.qk_norm:
            self.mup_zero_init = tuple(f"q_norms.{level}.weight" for level in range(len(self.ranks)))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Level weights ``N(0, 1/fan_in)`` (level by level, q then k), then the norms, ``value`` and ``proj``: the
        order of the constructor's draws."""
        for name, fan_in in self.mup_fan_in.items():
            getattr(self, name).normal_(0.0, 1.0 / math.sqrt(fan_in))
        super().reset_parameters()

    def level_weight(self, side: str, level: int) -> Tensor:
        """The effective (RMS-capped when ``rms_cap``) ``W_Q^(l)`` or ``W_K^(l)``, (p_l, D/p_l, H r_l)."""
        weight = getattr(self, f"{side}_weight_{level}")
        if self.rms_cap:
            weight = rms_cap(weight, weight.shape[1], weight.shape[2])
        return weight

    def _project(self, x: Tensor, side: str, level: int) -> Tensor:
        """One level's per-head query or key, (batch, length, heads, r_l * p_l), layout ``rho * p_l + k``."""
        b, l, _ = x.shape
        r, p = self.ranks[level], self.num_blocks[level]
        chunks = x.reshape(b, l, p, self.dim // p)
        out = torch.einsum("btpi,pio->btpo", chunks, self.level_weight(side, level))  # (b, l, p, H*r)
        out = out.view(b, l, p, self.num_heads, r).permute(0, 1, 3, 4, 2).reshape(b, l, self.num_heads, r * p)
        norms = self.q_norms if side == "q" else self.k_norms
        return norms[level](out) if norms is not None else out

    def prepare(self, x: Tensor, mask: Tensor | None) -> LevelsContext:
        b, l, _ = x.shape
        levels = range(len(self.ranks))
        q_levels = [self._project(x, "q", level) for level in levels]
        k_levels = [self._project(x, "k", level) for level in levels]
        values = self.value(x).view(b, l, self.num_heads, self.head_dim)
        return LevelsContext(values=values, mask=mask, q_levels=q_levels, k_levels=k_levels)

    def qk(self, ctx: LevelsContext) -> tuple[Tensor, Tensor]:
        # All levels in one product: the scales go on the queries, and the widths concatenate.
        q = torch.cat([q * s for q, s in zip(ctx.q_levels, self.level_scales)], dim=-1)
        return q, torch.cat(ctx.k_levels, dim=-1)

    def matrix(self, ctx: LevelsContext) -> Tensor:
        scores = reduce(operator.add, (dot_scores(q, k) * s for q, k, s in zip(ctx.q_levels, ctx.k_levels,
                                                                                self.level_scales)))
        return self.weights(scores, ctx.mask)

    def bilinear_matrices(self) -> Tensor:
        """Per head, ``W_h = sum_l tau_l blockdiag_k(W_Q^(l)[k]_h W_K^(l)[k]_h^T)``, (heads, D, D).

        The score is ``x_i^T W_h x_j`` exactly when ``qk_norm`` is off (the LN makes it non-bilinear otherwise).
        """
        mats = []
        for level, (r, p, s) in enumerate(zip(self.ranks, self.num_blocks, self.level_scales)):
            wq = self.level_weight("q", level).view(p, self.dim // p, self.num_heads, r)
            wk = self.level_weight("k", level).view(p, self.dim // p, self.num_heads, r)
            blocks = torch.einsum("pahr,pbhr->hpab", wq, wk) * s  # (H, p, D/p, D/p)
            mats.append(torch.stack([torch.block_diag(*blocks[h].unbind(0)) for h in range(self.num_heads)]))
        return reduce(operator.add, mats)

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        tokens = batch * length
        return {
            # each level maps p chunks of D/p to H r_l: D * H * r_l MACs per token, summed over levels and q, k
            "qk_proj": 2 * 2 * tokens * self.dim * self.num_heads * sum(self.ranks),
            "value_proj": 2 * tokens * self.dim * self.dim,
            "scores": 2 * batch * self.num_heads * length * length * self.key_width,
            "weighted_values": 2 * batch * self.num_heads * length * length * self.head_dim,
            "out_proj": 2 * tokens * self.dim * self.dim,
        }


SPEC = MixerSpec(
    name="bilinear_mlr_attention",
    aliases=("bmlr_attention",),
    config=BilinearMLRAttentionConfig,
    builder=BilinearMLRAttention,
    summary="softmax attention scored by a multi-level low-rank bilinear form on the features (Kuang et al. 2025)",
    matrix_class="dense (softmax of a feature-axis MLR bilinear form)",
    direction="either",
    complexity="O(L^2 sum_l r_l p_l)",
    data_dependent="yes",
    stepping=True,
    # Ranks left to their default (the head dim split over 4 levels), so the options fit any dim divisible by 8.
    test_options={"num_heads": 2},
)
