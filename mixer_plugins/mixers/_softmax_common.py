"""Pieces shared by the structured softmax-attention mixers (Kuang et al. 2025) and their baselines.

``btt_attention``, ``mlr_attention``, ``bilinear_mlr_attention``, ``sliding_window_attention`` and
``global_local_attention`` all compute ``softmax_j(score(i, j))`` over allowed keys and apply it to value heads; they
differ in the score. Here: their options, the fused (SDPA) and sliding-window paths, and their base classes.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from ..kernels import LocalPlan, local_attention_flops
from ..kernels import local_attention as _local_attention_op
from ..layers.masks import (
    attention_bias_mask,
    causal_nonfinite_guard_many,
    dense_allowed,
    masked_softmax,
    poison_after,
)
from ..layers.mup import attention_logit_scale
from ..registry.spec import MixerConfig
from .base import CtxT, MatrixMixer, QKContext
from .cache import MixerCache, append_kv, fill_kv, init_kv

__all__ = [
    "AttentionLinkOptions", "LevelRanksConfig", "LocalPlan", "QKNormOptions", "QKVSoftmaxConfig", "QKVSoftmaxMixer",
    "SoftmaxMixer", "SoftmaxMixerConfig", "StructuredSoftmaxMixer", "attention_weights", "cached_attention",
    "dot_scores", "fused_attention", "local_attention", "local_attention_flops",
]


class SoftmaxMixerConfig(MixerConfig):
    """Options every structured softmax mixer has."""

    num_heads: int = Field(8, gt=0, description="number of heads (value heads of width dim // num_heads)")
    causal: bool = Field(False, description="mask future positions (decoder-style attention)")
    proj_bias: bool = Field(False, description="bias in the input and output projections (the paper uses none)")
    logit_scaling: Literal["standard", "mup"] = Field(
        "standard",
        description="logit scale rule: 'standard' = multiplier/sqrt(d), 'mup' = multiplier/d, where d is the "
        "width of the dot product (head dim, level rank, or dim for BTT)",
    )
    logit_multiplier: float = Field(1.0, gt=0, description="multiplier of the logit scale (the paper's muP uses 8)")

    @model_validator(mode="after")
    def _check_heads(self) -> SoftmaxMixerConfig:
        if self.dim % self.num_heads != 0:
            raise ValueError(
                f"dim ({self.dim}) is not divisible by num_heads ({self.num_heads}); choose num_heads dividing dim"
            )
        return self

    @property
    def head_dim(self) -> int:
        """Width of each value head, ``dim // num_heads``."""
        return self.dim // self.num_heads

    def logit_scale(self, dot_dim: int) -> float:
        """The factor applied to a ``dot_dim``-wide query-key dot product under this config's rule."""
        return attention_logit_scale(dot_dim, self.logit_scaling, self.logit_multiplier)


class AttentionLinkOptions(MixerConfig):
    """Mixin options of the structured-attention mixers that follow the paper's code past the scores: the link
    function that turns scores into weights and dropout on those weights."""

    link_function: Literal["softmax", "identity"] = Field(
        "softmax",
        description="scores -> weights: 'softmax' over allowed keys, or 'identity' (the paper's code option: the "
        "raw scaled scores, masked entries set to 0, no normalisation)",
    )
    attn_dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="dropout probability on the attention weights (training only; the paper's code `dropout`)",
    )


class QKNormOptions(MixerConfig):
    """Mixin options of the mixers with LayerNorms on their queries and keys (QK-LN)."""

    qk_norm: bool = Field(
        True, description="LayerNorm on queries and keys over their per-head width, shared by heads (the paper's "
        "QK-LN; Bilinear-MLR has one per level)"
    )
    ln_bias: bool = Field(
        False, description="a learned bias in the QK LayerNorms: the paper's experiments ran without (their "
        "scripts set bias=False); the released code's model configs default to bias=True, so set it to load those"
    )

    @model_validator(mode="after")
    def _check_ln_bias(self) -> QKNormOptions:
        if self.ln_bias and not self.qk_norm:
            raise ValueError("ln_bias=True needs qk_norm=True: the bias belongs to the query/key LayerNorms")
        return self


#: Levels of the multi-level mixers when no rank list is given.
DEFAULT_LEVELS = 4


class LevelRanksConfig(SoftmaxMixerConfig):
    """The rank list of the multi-level mixers (MLR on the sequence axis, Bilinear-MLR on the feature axis)."""

    ranks: Optional[list[int]] = Field(
        None,
        description="rank r_l of each level (its slice of the head dim); must sum to dim // num_heads. "
        f"Default: the head dim split equally over {DEFAULT_LEVELS} levels",
    )

    @model_validator(mode="after")
    def _check_ranks(self) -> LevelRanksConfig:
        head_dim = self.head_dim
        if self.ranks is None:
            if head_dim % DEFAULT_LEVELS:
                raise ValueError(
                    f"the head dim ({head_dim}) does not split equally over {DEFAULT_LEVELS} levels; "
                    f"pass ranks=[...] summing to {head_dim}"
                )
        elif not self.ranks or any(r <= 0 for r in self.ranks):
            raise ValueError(f"ranks must be a non-empty list of positive integers, got {self.ranks}")
        elif sum(self.ranks) != head_dim:
            raise ValueError(
                f"ranks {self.ranks} sum to {sum(self.ranks)}, but must sum to the head dim "
                f"dim // num_heads = {head_dim}"
            )
        return self

    def resolved_ranks(self) -> list[int]:
        """The rank of each level (the default split when ``ranks`` is None)."""
        if self.ranks is not None:
            return list(self.ranks)
        return [self.head_dim // DEFAULT_LEVELS] * DEFAULT_LEVELS


class QKVSoftmaxConfig(SoftmaxMixerConfig, QKNormOptions):
    """Options of the mixers whose queries and keys are ordinary per-head projections."""


# -- scores and the fused path ----------------------------------------------------------------------------------------

def dot_scores(q: Tensor, k: Tensor) -> Tensor:
    """Per-head dot products of every query with every key: (batch, L, heads, e) x 2 -> (batch, heads, L, L), a
    fresh tensor (``matmul``, not a view), so callers may update it in place."""
    return torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1))


def attention_weights(scores: Tensor, allowed: Tensor | None, link: str = "softmax", dropout: float = 0.0,
                      training: bool = False) -> Tensor:
    """Scores (batch, heads, L, L) -> attention weights: the link function, then dropout (training only).

    ``link="softmax"``: :func:`~mixer_plugins.layers.masks.masked_softmax` over ``allowed`` keys;
    ``link="identity"``: the scores themselves with disallowed entries set to 0 (a select, so a non-finite score of a
    disallowed pair never leaks).
    """
    if link == "softmax":
        weights = masked_softmax(scores, allowed)
    elif link == "identity":
        weights = scores if allowed is None else torch.where(allowed, scores, scores.new_zeros(()))
    else:
        raise ValueError(f"unknown link function {link!r}; expected 'softmax' or 'identity'")
    if dropout and training:
        weights = F.dropout(weights, p=dropout, training=True)
    return weights


def cached_attention(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor, scale: float,
                     link: str = "softmax") -> Tensor:
    """A step's queries against cached keys: (batch, t, heads, e) x (batch, slots, heads, e) -> (batch, t, heads, p).

    ``allowed`` is bool (batch, t, slots); the weights are :func:`attention_weights` of the scaled scores (no
    dropout: decoding is inference). The softmax link is one SDPA call. SDPA masks by adding -inf, so only finite
    slots may be masked: those past a row's length hold zeros, and a row that has seen a non-finite token gives NaN
    from there on under the non-finite guard anyway.
    """
    if link == "softmax":
        y = F.scaled_dot_product_attention(_sdpa_layout(q).transpose(1, 2), keys.transpose(1, 2),
                                           values.transpose(1, 2), attn_mask=allowed.unsqueeze(1), scale=scale)
        return y.transpose(1, 2)
    scores = torch.einsum("bthe,bjhe->bhtj", q, keys) * scale
    weights = attention_weights(scores, allowed[:, None], link)
    return torch.einsum("bhtj,bjhp->bthp", weights, values)


def _sdpa_layout(t: Tensor) -> Tensor:
    """``t`` with unit feature stride and no broadcast (stride-0) axis, copied only if needed. cuDNN's SDPA (bf16 on
    CUDA) derives its output's layout from the query's and fails on a query broadcast over the heads, as BTT's is
    ("The stride for the last dimension ... should be 1 for output O")."""
    return t if t.stride(-1) == 1 and 0 not in t.stride() else t.contiguous()


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float,
                    guard: bool = False) -> Tensor:
    """``softmax(scale * q k^T) v`` with causal/padding masks, via PyTorch's SDPA.

    ``q, k``: (batch, length, heads, e), ``v``: (batch, length, heads, p); returns (batch, length, heads, p).
    Query/key and value widths may differ. ``guard`` (causal): the mixer's non-finite guard is on.
    """
    poisoned = None
    if causal and guard:  # SDPA masks by adding -inf: a non-finite future key or value reaches the past (NaN + -inf)
        (q, k, v), poisoned = causal_nonfinite_guard_many(q, k, v)
    q, k, v = (_sdpa_layout(t).transpose(1, 2) for t in (q, k, v))
    allowed = attention_bias_mask(mask, q.shape[2], causal, q.device) if mask is not None else None
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal and mask is None, scale=scale)
    return poison_after(y.transpose(1, 2), poisoned)


def local_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool, mask: Tensor | None,
                    scale: float, guard: bool = False) -> Tensor:
    """Sliding-window softmax attention in O(L * window): each query ``i`` sees keys ``|i - j| <= window``
    (causal: ``i - window <= j <= i``), pads excluded.

    ``q, k``: (batch, length, heads, e), ``v``: (batch, length, heads, p) -> (batch, length, heads, p). Runs the
    kernel op :func:`mixer_plugins.kernels.local_attention` (automatic backend: on CUDA our Triton kernel, which
    never visits the key tiles outside the band; elsewhere the blocked PyTorch path, see
    :class:`~mixer_plugins.kernels.LocalPlan`). ``guard`` (causal): the mixer's non-finite guard is on.
    """
    if causal and guard:  # a zero probability times a non-finite future value is NaN: isolate such tokens (selection)
        (q, k, v), poisoned = causal_nonfinite_guard_many(q, k, v)
        return poison_after(_local_attention_op(q, k, v, window=window, causal=True, mask=mask, scale=scale),
                            poisoned)
    return _local_attention_op(q, k, v, window=window, causal=causal, mask=mask, scale=scale)


# -- the base classes -------------------------------------------------------------------------------------------------

class SoftmaxMixer(MatrixMixer[CtxT]):
    """Base of the softmax mixers: ``num_heads`` value heads of ``head_dim``, the output projection ``proj`` (built by
    the subclass) and, for decoding, a KV cache of every token: the keys of :meth:`qk`, ``key_width`` wide."""

    steppable = True
    proj: nn.Linear
    key_width: int

    def __init__(self, config: SoftmaxMixerConfig):
        super().__init__(config)
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim

    def qk(self, ctx: CtxT) -> tuple[Tensor, Tensor]:
        """Per-head queries and keys (batch, length, heads, key_width) of the fused path and the KV cache."""
        raise NotImplementedError

    def finish(self, ctx: CtxT, y: Tensor) -> Tensor:
        return self.proj(y.flatten(2))

    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        init_kv(cache, batch, max_len, self.num_heads, self.key_width, self.head_dim, dtype, device)

    def fill_cache(self, cache: MixerCache, ctx: CtxT, x: Tensor, lengths: Tensor) -> Tensor:
        fill_kv(cache, self.qk(ctx)[1], ctx.values)
        return self.mix(ctx)


class StructuredSoftmaxMixer(SoftmaxMixer[CtxT]):
    """Base of the mixers that follow the paper's code past the scores (BTT, MLR, Bilinear-MLR): the link function
    and attention dropout, the logits probe :meth:`attention_logits`, and a fast path that falls back to the
    materialized one when the link or dropout needs the weights."""

    #: The logit scale of :meth:`qk`'s dot products (1 where the queries carry it).
    scale: float = 1.0
    link_function: str
    attn_dropout: float

    def __init__(self, config: SoftmaxMixerConfig):
        super().__init__(config)
        assert isinstance(config, AttentionLinkOptions), "the structured mixers' configs have the link options"
        self.link_function = config.link_function
        self.attn_dropout = config.attn_dropout

    def logits(self, ctx: CtxT) -> Tensor:
        """Pre-link (pre-softmax) scaled scores, unmasked, (batch, heads, L, L)."""
        q, k = self.qk(ctx)
        return dot_scores(q, k) * self.scale

    def attention_logits(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """Pre-softmax logits (batch, heads, L, L) for input ``x`` (scale included, before masking): the
        :class:`~mixer_plugins.layers.mup.AttentionLogitsProbe` the coordinate check records."""
        x, mask, _ = self._begin(x, mask)
        return self.logits(self.prepare(x, mask))

    def weights(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        """Scores -> attention weights: causal and pad masks, the link function, dropout (training only)."""
        allowed = dense_allowed(mask, scores.shape[-1], self.causal, scores.device)
        return attention_weights(scores, allowed, self.link_function, self.attn_dropout, self.training)

    def uses_tiled_op(self) -> bool:
        """Whether :meth:`mix` runs the fast op (memory linear in L: SDPA, or MLR's tiled op) rather than the
        materialized ``L x L`` path: it does unless dropout is active (``attn_dropout > 0`` in training mode) or the
        link is ``"identity"``."""
        return self.link_function == "softmax" and not (self.attn_dropout and self.training)

    def mix(self, ctx: CtxT) -> Tensor:
        if not self.uses_tiled_op():
            return self.mix_materialized(ctx)
        q, k = self.qk(ctx)
        return fused_attention(q, k, ctx.values, ctx.mask, self.causal, self.scale, self.guard_nonfinite)

    def mix_materialized(self, ctx: CtxT) -> Tensor:
        """The materialized path: :meth:`logits` into one dense ``L x L`` per head, link, dropout, ``A V``."""
        return torch.einsum("bhij,bjhp->bihp", self.weights(self.logits(ctx), ctx.mask), ctx.values)

    def mix_step(self, ctx: CtxT, cache: MixerCache) -> Tensor:
        q, k = self.qk(ctx)
        _, allowed = append_kv(cache, k, ctx.values)
        return cached_attention(q, cache.read("k", q.dtype), cache.read("v", q.dtype), allowed, self.scale,
                                self.link_function)


class QKVSoftmaxMixer(SoftmaxMixer[QKContext]):
    """Base of the mixers with dense q/k/v projections (MLR, SWA, GSWA): ``qkv``, optional QK-LN, ``proj``.

    ``prepare`` puts the (normalised) queries and keys in ``ctx.q``/``ctx.k`` and the values in ``ctx.values``, all
    (batch, length, heads, head_dim); subclasses write the score, the matrix and the fast path.
    """

    def __init__(self, config: QKVSoftmaxConfig):
        super().__init__(config)
        self.key_width = self.head_dim
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=config.proj_bias)
        self.q_norm: nn.LayerNorm | None = None
        self.k_norm: nn.LayerNorm | None = None
        if config.qk_norm:
            self.q_norm = nn.LayerNorm(self.head_dim, bias=config.ln_bias)
            self.k_norm = nn.LayerNorm(self.head_dim, bias=config.ln_bias)
            # muP zero-initialises the query (Yang et al., Tensor Programs V): logits are then exactly 0 at init
            # at every width. Behind QK-LN that is the query LN's gain (zero W_q would put LN at its singular point).
            self.mup_zero_init = ("q_norm.weight",)
        self.proj = nn.Linear(config.dim, config.dim, bias=config.proj_bias)

    def prepare(self, x: Tensor, mask: Tensor | None) -> QKContext:
        b, l, _ = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.num_heads, self.head_dim).unbind(2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return QKContext(values=v, mask=mask, q=q, k=k)

    def qk(self, ctx: QKContext) -> tuple[Tensor, Tensor]:
        return ctx.q, ctx.k

    def projection_flops(self, batch: int, length: int) -> dict[str, int]:
        """FLOPs of the q/k/v and output projections."""
        tokens = batch * length
        return {"qkv_proj": 2 * tokens * self.dim * 3 * self.dim, "out_proj": 2 * tokens * self.dim * self.dim}
