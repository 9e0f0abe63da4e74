"""``global_local_attention``: global + sliding-window attention splitting the head dim (the GSWA baseline of
Kuang et al. 2025).

After QK-LN over the head dim, queries and keys are split into a global part (the first ``global_dim`` dims) and a
local part (the remaining ``head_dim - global_dim``). Two softmaxes, one over every allowed key with the global part,
one over the sliding window with the local part, are **added** (each row of the mixer's matrix sums to 2, as in the
paper's code) and applied to the full-width values::

    P = softmax(tau_g q_g k_g^T + causal mask) + softmax(tau_l q_l k_l^T + window mask),     y = P V

The paper's code scales each part by ``8 / width`` (muP rule, multiplier 8), which is this mixer's default. The
global part uses the fused (SDPA) kernel, the local part the blocked ``O(L * window)`` kernel of
``sliding_window_attention``.

Decoding (causal) keeps the keys and values of every token (the global part needs them all); a step adds its two
softmaxes over the cache, the local one restricted to the window.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ..layers.masks import dense_allowed, masked_softmax
from ..registry.spec import MixerSpec
from ._softmax_common import (
    QKVSoftmaxConfig,
    QKVSoftmaxMixer,
    cached_attention,
    dot_scores,
    fused_attention,
    local_attention,
    local_attention_flops,
)
from .base import QKContext
from .cache import MixerCache, append_kv

__all__ = ["GlobalLocalAttention", "GlobalLocalAttentionConfig", "SPEC"]


class GlobalLocalAttentionConfig(QKVSoftmaxConfig):
    """Options of global + sliding-window attention."""

    window: int = Field(512, gt=0, description="window of the local part (causal: the window previous tokens and self)")
    global_dim: Optional[int] = Field(
        None, gt=0, description="query/key dims of the global part (the rest is local); default head_dim // 2"
    )
    logit_scaling: Literal["standard", "mup"] = Field(
        "mup", description="scale of each part: 'mup' = multiplier/width (the paper: 8/width), 'standard' = "
        "multiplier/sqrt(width)",
    )
    logit_multiplier: float = Field(8.0, gt=0, description="multiplier of the logit scale")

    @model_validator(mode="after")
    def _check_split(self) -> GlobalLocalAttentionConfig:
        head_dim = self.dim // self.num_heads
        if head_dim < 2:
            raise ValueError(f"the head dim ({head_dim}) must be at least 2 to split into a global and a local part")
        if self.global_dim is not None and self.global_dim >= head_dim:
            raise ValueError(
                f"global_dim ({self.global_dim}) must be smaller than the head dim ({head_dim}) so that the local "
                "part keeps at least one dim"
            )
        return self

    def resolved_global_dim(self) -> int:
        """Query/key dims of the global part (``head_dim // 2`` unless ``global_dim`` is set)."""
        return self.global_dim if self.global_dim is not None else (self.dim // self.num_heads) // 2


class GlobalLocalAttention(QKVSoftmaxMixer):
    """GSWA: global softmax on the first ``global_dim`` q/k dims plus windowed softmax on the rest."""

    def __init__(self, config: GlobalLocalAttentionConfig):
        super().__init__(config)
        self.window = config.window
        self.global_dim = config.resolved_global_dim()
        self.local_dim = self.head_dim - self.global_dim
        self.global_scale = config.logit_scale(self.global_dim)
        self.local_scale = config.logit_scale(self.local_dim)

    def _split(self, t: Tensor) -> tuple[Tensor, Tensor]:
        return t[..., : self.global_dim], t[..., self.global_dim:]

    def mix(self, ctx: QKContext) -> Tensor:
        (qg, ql), (kg, kl) = self._split(ctx.q), self._split(ctx.k)
        y_global = fused_attention(qg, kg, ctx.values, ctx.mask, self.causal, self.global_scale,
                                   self.guard_nonfinite)
        y_local = local_attention(ql, kl, ctx.values, window=self.window, causal=self.causal, mask=ctx.mask,
                                  scale=self.local_scale, guard=self.guard_nonfinite)
        return y_global + y_local

    def matrix(self, ctx: QKContext) -> Tensor:
        (qg, ql), (kg, kl) = self._split(ctx.q), self._split(ctx.k)
        length, device = ctx.q.shape[1], ctx.q.device
        p_global = masked_softmax(dot_scores(qg, kg) * self.global_scale,
                                  dense_allowed(ctx.mask, length, self.causal, device))
        p_local = masked_softmax(dot_scores(ql, kl) * self.local_scale,
                                 dense_allowed(ctx.mask, length, self.causal, device, window=self.window))
        return p_global + p_local

    def mix_step(self, ctx: QKContext, cache: MixerCache) -> Tensor:
        positions, allowed = append_kv(cache, ctx.k, ctx.values)
        keys, values = cache.read("k", ctx.q.dtype), cache.read("v", ctx.q.dtype)
        (qg, ql), (kg, kl) = self._split(ctx.q), self._split(keys)
        slots = torch.arange(cache.max_len, device=positions.device)
        in_window = allowed & (slots[None, None, :] >= positions[:, :, None] - self.window)
        return (cached_attention(qg, kg, values, allowed, self.global_scale)
                + cached_attention(ql, kl, values, in_window, self.local_scale))

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        proj = self.projection_flops(batch, length)
        dense_pairs = batch * self.num_heads * length * length
        local = local_attention_flops(batch, self.num_heads, length, self.window, self.causal,
                                      self.local_dim, self.head_dim)
        return {
            "qkv_proj": proj["qkv_proj"],
            "global_scores": 2 * dense_pairs * self.global_dim,
            "global_weighted_values": 2 * dense_pairs * self.head_dim,
            "local_scores": local["scores"],
            "local_weighted_values": local["weighted_values"],
            "out_proj": proj["out_proj"],
        }


SPEC = MixerSpec(
    name="global_local_attention",
    aliases=("gswa",),
    config=GlobalLocalAttentionConfig,
    builder=GlobalLocalAttention,
    summary="global + sliding-window softmax attention on split head dims (baseline of Kuang et al. 2025)",
    matrix_class="dense + banded (sum of two softmaxes)",
    direction="either",
    complexity="O(L^2)",
    data_dependent="yes",
    stepping=True,
    test_options={"num_heads": 2, "window": 3},
)
