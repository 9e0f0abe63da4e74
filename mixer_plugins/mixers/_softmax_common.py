"""Pieces shared by the structured softmax-attention mixers (Kuang et al. 2025) and their baselines.

``btt_attention``, ``mlr_attention``, ``bilinear_mlr_attention``, ``sliding_window_attention`` and
``global_local_attention`` all compute ``softmax_j(score(i, j))`` over allowed keys and apply it to value heads;
they differ in the score. This module holds what they share: the common options, the logit scale, a fused (SDPA)
path, the blocked sliding-window kernel, and the q/k/v base class of the mixers whose queries and keys are ordinary
projections. The masks live in :mod:`mixer_plugins.layers.masks`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, Optional, Protocol

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from ..kernels import LocalPlan, local_attention_flops
from ..kernels import local_attention as _local_attention_op
from ..layers.masks import (
    attention_bias_mask,
    causal_nonfinite_guard_many,
    masked_softmax,
    poison_after,
)
from ..layers.mup import attention_logit_scale
from ..registry.spec import MixerConfig
from .base import MatrixMixer, QKContext
from .cache import MixerCache, append_kv, fill_kv, init_kv

__all__ = [
    "AttentionLinkOptions",
    "AttentionLogitsMixin",
    "LevelRanksConfig",
    "LocalPlan",
    "QKVSoftmaxMixer",
    "QKVSoftmaxConfig",
    "SoftmaxMixerConfig",
    "attention_weights",
    "cached_attention",
    "dot_scores",
    "fused_attention",
    "local_attention",
    "local_attention_flops",
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


class _LogitsMixer(Protocol):
    """What :class:`AttentionLogitsMixin` needs of the mixer it is mixed into."""

    def _begin(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]: ...

    def prepare(self, x: Tensor, mask: Tensor | None) -> Any: ...

    def logits(self, ctx: Any) -> Tensor: ...


class AttentionLogitsMixin:
    """Gives a softmax mixer with a ``logits(ctx)`` method the public probe
    :meth:`attention_logits` (the :class:`~mixer_plugins.layers.mup.AttentionLogitsProbe` protocol the coordinate check
    uses to record attention logits)."""

    def attention_logits(self: _LogitsMixer, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """Pre-softmax logits (batch, heads, L, L) for input ``x`` (scale included, before masking)."""
        x, mask, _ = self._begin(x, mask)
        return self.logits(self.prepare(x, mask))


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
        head_dim = self.dim // self.num_heads
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


class QKVSoftmaxConfig(SoftmaxMixerConfig):
    """Options of the mixers whose queries and keys are ordinary per-head projections."""

    qk_norm: bool = Field(
        True, description="LayerNorm on queries and keys over the head dim, shared by heads (the paper's QK-LN)"
    )
    ln_bias: bool = Field(
        False, description="a learned bias in the QK LayerNorms: the paper's experiments ran without (their "
        "scripts set bias=False); the released code's model configs default to bias=True, so set it to load those"
    )

    @model_validator(mode="after")
    def _check_ln_bias(self) -> QKVSoftmaxConfig:
        if self.ln_bias and not self.qk_norm:
            raise ValueError("ln_bias=True needs qk_norm=True: the bias belongs to the query/key LayerNorms")
        return self


# -- scores and the fused path ----------------------------------------------------------------------------------------

def tensor_sum(terms: Iterable[Tensor]) -> Tensor:
    """The sum of one or more tensors, added left to right as they come (what the builtin ``sum`` gives, without its
    ``0``): pass a generator, and only the running total and one term exist at a time."""
    it = iter(terms)
    try:
        total = next(it)
    except StopIteration:
        raise ValueError("tensor_sum needs at least one term") from None
    for term in it:
        total = total + term
    return total


def dot_scores(q: Tensor, k: Tensor) -> Tensor:
    """Per-head dot products of every query with every key: (batch, L, heads, e) x 2 -> (batch, heads, L, L).

    Written with ``matmul``, whose result is a fresh tensor (not a view), so callers may update it in place.
    """
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


# -- sliding-window attention ------------------------------------------------------------------------------------

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


# -- the q/k/v base class ---------------------------------------------------------------------------------------------

class QKVSoftmaxMixer(MatrixMixer[QKContext]):
    """Base of the mixers with dense q/k/v projections (MLR, SWA, GSWA): ``qkv``, optional QK-LN, ``proj``.

    ``prepare`` puts the (normalised) queries and keys in ``ctx.q``/``ctx.k`` and the values in ``ctx.values``, all
    (batch, length, heads, head_dim); subclasses write the score, the matrix and the fast path.
    """

    def __init__(self, config: QKVSoftmaxConfig):
        super().__init__(config)
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
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

    def finish(self, ctx: QKContext, y: Tensor) -> Tensor:
        return self.proj(y.flatten(2))

    # -- decoding (causal): a KV cache of every token; subclasses score against it ------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        init_kv(cache, batch, max_len, self.num_heads, self.head_dim, self.head_dim, dtype, device)

    def fill_cache(self, cache: MixerCache, ctx: QKContext, x: Tensor, lengths: Tensor) -> Tensor:
        fill_kv(cache, ctx.k, ctx.values)
        return self.mix(ctx)

    def append_kv(self, ctx: QKContext, cache: MixerCache) -> tuple[Tensor, Tensor]:
        """Write a step's keys and values into the KV cache; returns the positions (batch, t) and the allowed
        slots (batch, t, max_len) of its queries (slot ``j <= position``)."""
        return append_kv(cache, ctx.k, ctx.values)

    def projection_flops(self, batch: int, length: int) -> dict[str, int]:
        """FLOPs of the q/k/v and output projections."""
        tokens = batch * length
        return {"qkv_proj": 2 * tokens * self.dim * 3 * self.dim, "out_proj": 2 * tokens * self.dim * self.dim}
