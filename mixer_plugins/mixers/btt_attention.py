"""``btt_attention``: Bilinear-BTT softmax attention (Kuang et al. 2025).

Every head scores with its own full-rank-capable ``D x D`` matrix ``M_h``, a block tensor-train (BTT) of rank ``s``
(``s = 1`` is Monarch)::

    score_h(i, j) = tau * x_i . LN( M_h x_j ),         M_h[(a, b), (g, d)] = sum_s L[(h, b), a, g, s] R[g, d, (h, b, s)]

The query is the raw input; the LayerNorm over ``D`` on the transformed key is shared by the heads (BTT's QK-LN).
``D = c * d`` with ``(c, d) = factorize(D)`` unless ``factors`` is given; as in the paper's code the output factors
equal the input ones. The key transform is an :class:`~mixer_plugins.layers.mlbtc.MLBTC` (one BTT level, the heads
folded into its ``n2`` factor), so muP knows its cores' fan-ins. Decoding (causal) keeps every token's transformed
keys and values.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from ..layers.mlbtc import MLBTC, BTCLevel, factorize
from ..registry.spec import MixerSpec
from ._softmax_common import AttentionLinkOptions, SoftmaxMixerConfig, StructuredSoftmaxMixer
from .base import MixerContext

__all__ = ["BTTAttention", "BTTAttentionConfig", "BTTContext", "SPEC"]


@dataclasses.dataclass(eq=False, kw_only=True)
class BTTContext(MixerContext):
    """``query``: the (optionally normalised) input, (batch, length, dim): BTT scores the raw tokens."""

    query: Tensor


class BTTAttentionConfig(SoftmaxMixerConfig, AttentionLinkOptions):
    """Options of Bilinear-BTT attention."""

    btt_rank: int = Field(1, gt=0, description="BTT rank s of each head's D x D score matrix (1 = Monarch)")
    factors: Optional[list[int]] = Field(
        None, description="[c, d] with c * d = dim; default: d = smallest divisor of dim above sqrt(dim)"
    )
    input_norm: bool = Field(
        False, description="extra LayerNorm on x before scoring and before the value projection, as the paper's "
        "code (bilinearBTT_use_extra_LN_on_X, set by its ViT) does"
    )
    rms_cap: bool = Field(True, description="cap the RMS of the BTT cores in the forward pass (see muP docs)")
    ln_bias: bool = Field(
        False, description="a learned bias in the key LayerNorm (and the input one): the paper's experiments ran "
        "without (their scripts set bias=False); the released code's model configs and ViT default to bias=True, so "
        "set it to load those"
    )

    @model_validator(mode="after")
    def _check_factors(self) -> BTTAttentionConfig:
        if self.factors is not None:
            if len(self.factors) != 2 or any(f <= 0 for f in self.factors):
                raise ValueError(f"factors must be two positive integers [c, d], got {self.factors}")
            c, d = self.factors
            if c * d != self.dim:
                raise ValueError(f"factors {self.factors} multiply to {c * d}, not dim={self.dim}")
        return self

    def resolved_factors(self) -> tuple[int, int]:
        """``(c, d)`` with ``c * d = dim``."""
        if self.factors is None:
            return factorize(self.dim)
        c, d = self.factors  # two, by the validator
        return c, d


class BTTAttention(StructuredSoftmaxMixer[BTTContext]):
    """Bilinear-BTT attention. ``key_transform`` is the MLBTC of all heads' ``M_h``; ``key_norm`` the shared LN."""

    def __init__(self, config: BTTAttentionConfig):
        super().__init__(config)
        dim = config.dim
        self.key_width = dim
        self.c, self.d = config.resolved_factors()
        self.btt_rank = config.btt_rank
        # Rows of the MLBTC are (alpha, (h, beta)) = (i1, i2); its cores have the paper's layouts:
        # left (1, H*b, a, c, s) ~ (H*b, a, c*s) and right (1, c, d, H*b, s) ~ (c, d, H*b*s).
        level = BTCLevel(out_factors=(self.c, self.num_heads * self.d), in_factors=(self.c, self.d),
                         rank=config.btt_rank)
        self.key_transform = MLBTC([level], rms_cap=config.rms_cap)
        self.key_norm = nn.LayerNorm(dim, bias=config.ln_bias)
        # muP zero-initialises the query side so that logits are 0 at init at every width; BTT's query is the raw
        # input, so the gain of the key LN takes that role.
        self.mup_zero_init = ("key_norm.weight",)
        self.input_norm = nn.LayerNorm(dim, bias=config.ln_bias) if config.input_norm else None
        self.value = nn.Linear(dim, dim, bias=config.proj_bias)
        self.proj = nn.Linear(dim, dim, bias=config.proj_bias)
        self.scale = config.logit_scale(dim)

    def _heads_last(self, z: Tensor) -> Tensor:
        """MLBTC output rows (alpha, h, beta) -> (h, alpha * b + beta): (..., H*D) -> (..., H, D)."""
        lead = z.shape[:-1]
        z = z.reshape(*lead, self.c, self.num_heads, self.d).movedim(-2, -3)
        return z.reshape(*lead, self.num_heads, self.dim)

    def key_matrices(self) -> Tensor:
        """Every head's ``M_h`` (with the RMS cap applied), (heads, dim, dim), row index ``alpha * d + beta``."""
        dense = self.key_transform.to_dense()  # (c*H*d, D), rows (alpha, h, beta)
        return self._heads_last(dense.T).permute(1, 2, 0)

    def prepare(self, x: Tensor, mask: Tensor | None) -> BTTContext:
        b, l, _ = x.shape
        # The paper's code normalises x once and projects the values from the normalised x too.
        query = self.input_norm(x) if self.input_norm is not None else x
        values = self.value(query).view(b, l, self.num_heads, self.head_dim)
        return BTTContext(values=values, mask=mask, query=query)

    def keys(self, ctx: BTTContext) -> Tensor:
        """LN(M_h x_j) through the cores (fast path), (batch, length, heads, dim)."""
        return self.key_norm(self._heads_last(self.key_transform(ctx.query)))

    def qk(self, ctx: BTTContext) -> tuple[Tensor, Tensor]:
        """The raw query broadcast over the heads, and the keys :meth:`keys`."""
        keys = self.keys(ctx)
        return ctx.query[:, :, None, :].expand(keys.shape), keys

    def matrix(self, ctx: BTTContext) -> Tensor:
        # Independent of the fast path: keys through the materialized M_h, scores and softmax written out.
        keys = self.key_norm(torch.einsum("bjg,heg->bjhe", ctx.query, self.key_matrices()))
        scores = torch.einsum("bie,bjhe->bhij", ctx.query, keys) * self.scale
        return self.weights(scores, ctx.mask)

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        tokens = batch * length
        return {
            "value_proj": 2 * tokens * self.dim * self.dim,
            "key_transform": 2 * tokens * self.key_transform.macs_per_vector(),  # H * D * s * (c + d) per token
            "scores": 2 * batch * self.num_heads * length * length * self.dim,
            "weighted_values": 2 * batch * self.num_heads * length * length * self.head_dim,
            "out_proj": 2 * tokens * self.dim * self.dim,
        }


SPEC = MixerSpec(
    name="btt_attention",
    aliases=("bilinear_btt_attention",),
    config=BTTAttentionConfig,
    builder=BTTAttention,
    summary="softmax attention scored by a full-rank BTT bilinear form per head (Kuang et al. 2025)",
    matrix_class="dense (softmax of a BTT bilinear form)",
    direction="either",
    complexity="O(L^2 H D)",
    data_dependent="yes",
    stepping=True,
    test_options={"num_heads": 2, "btt_rank": 2},
)
