"""``attention``: standard multi-head softmax attention, the baseline every other mixer is compared with.

Matrix: ``M_h = softmax_j(scale * q_i . k_j)`` (causal: ``j <= i``), applied to the value heads, followed
by the output projection. The fast path is ``torch.nn.functional.scaled_dot_product_attention``.

Decoding (causal) keeps the keys and values of every token (a KV cache of ``max_len`` slots per row); a step scores
its queries against all slots, those past each row's position masked: fixed shapes, work growing with ``max_len``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from ..kernels import flop_formulas  # noqa: F401  (so FlopCounterMode counts CPU SDPA)
from ..layers.masks import attention_bias_mask, masked_softmax
from ..registry.spec import MixerConfig, MixerSpec
from ._softmax_common import cached_attention
from .base import MatrixMixer, QKContext
from .cache import MixerCache, append_kv, append_kv_token, fill_kv, init_kv

__all__ = ["AttentionConfig", "SoftmaxAttention", "SPEC"]


class AttentionConfig(MixerConfig):
    """Options of standard multi-head attention (the bias switches mirror timm's ``qkv_bias``/``proj_bias``)."""

    num_heads: int = Field(8, gt=0, description="number of attention heads")
    head_dim: Optional[int] = Field(
        None, gt=0, description="width of each head; default dim // num_heads (dim must then be divisible)"
    )
    qkv_bias: bool = Field(True, description="bias in the q/k/v projections")
    out_bias: bool = Field(True, description="bias in the output projection")
    causal: bool = Field(False, description="mask future positions (decoder-style attention)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the attention probabilities (training)")
    scale: Optional[float] = Field(None, gt=0, description="logit scale; default 1/sqrt(head_dim)")

    @model_validator(mode="after")
    def _check_heads(self) -> AttentionConfig:
        if self.head_dim is None and self.dim % self.num_heads != 0:
            raise ValueError(
                f"dim ({self.dim}) is not divisible by num_heads ({self.num_heads}); "
                "choose num_heads dividing dim, or set head_dim"
            )
        return self


class SoftmaxAttention(MatrixMixer[QKContext]):
    """Multi-head softmax attention (q/k/v/out projections, SDPA fast path)."""

    steppable = True

    def __init__(self, config: AttentionConfig):
        super().__init__(config)
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim or config.dim // config.num_heads
        inner = self.num_heads * self.head_dim
        self.scale = config.scale if config.scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(config.dim, 3 * inner, bias=config.qkv_bias)
        self.proj = nn.Linear(inner, config.dim, bias=config.out_bias)
        self.dropout = config.dropout
        # muP (mixer_plugins.layers.mup) zero-initialises the query rows of the fused projection: logits start at 0.
        rows = slice(0, inner)
        self.mup_zero_init = (("qkv.weight", rows),) + ((("qkv.bias", rows),) if config.qkv_bias else ())

    def prepare(self, x: Tensor, mask: Tensor | None) -> QKContext:
        b, l, _ = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.num_heads, self.head_dim).unbind(2)
        return QKContext(values=v, mask=mask, q=q, k=k)

    def mix(self, ctx: QKContext) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in (ctx.q, ctx.k, ctx.values))
        # without padding, SDPA's own causal flag replaces an explicit mask
        allowed = attention_bias_mask(ctx.mask, q.shape[2], self.causal, q.device) if ctx.mask is not None else None
        y = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=allowed,
            is_causal=self.causal and ctx.mask is None,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
        )
        return y.transpose(1, 2)

    # -- decoding (causal) ----------------------------------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        init_kv(cache, batch, max_len, self.num_heads, self.head_dim, self.head_dim, dtype, device)

    def fill_cache(self, cache: MixerCache, ctx: QKContext, x: Tensor, lengths: Tensor) -> Tensor:
        fill_kv(cache, ctx.k, ctx.values)
        return self.mix(ctx)

    def step_tokens(self, x: Tensor, cache: MixerCache) -> Tensor:
        """One token: its q/k/v (one matmul), the keys and values written in place, one SDPA call over the cache, the
        output projection. Several tokens take the general path."""
        b, t, _ = x.shape
        if t != 1:
            return super().step_tokens(x, cache)
        q, k, v = F.linear(x.view(b, -1), self.qkv.weight, self.qkv.bias).view(b, 1, 3, self.num_heads,
                                                                               self.head_dim).unbind(2)
        allowed = append_kv_token(cache, k, v)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), cache.read("k", q.dtype).transpose(1, 2),
                                           cache.read("v", q.dtype).transpose(1, 2), attn_mask=allowed,
                                           scale=self.scale)
        return F.linear(y.view(b, -1), self.proj.weight, self.proj.bias).view(b, 1, -1)

    def mix_step(self, ctx: QKContext, cache: MixerCache) -> Tensor:
        _, allowed = append_kv(cache, ctx.k, ctx.values)
        return cached_attention(ctx.q, cache.read("k", ctx.q.dtype), cache.read("v", ctx.q.dtype), allowed, self.scale)

    def matrix(self, ctx: QKContext) -> Tensor:
        scores = torch.einsum("bihd,bjhd->bhij", ctx.q, ctx.k) * self.scale
        return masked_softmax(scores, attention_bias_mask(ctx.mask, scores.shape[-1], self.causal, scores.device))

    def finish(self, ctx: QKContext, y: Tensor) -> Tensor:
        return self.proj(y.flatten(2))

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        inner = self.num_heads * self.head_dim
        tokens = batch * length
        return {
            "qkv_proj": 2 * tokens * self.dim * 3 * inner,
            "scores": 2 * batch * self.num_heads * length * length * self.head_dim,
            "weighted_values": 2 * batch * self.num_heads * length * length * self.head_dim,
            "out_proj": 2 * tokens * inner * self.dim,
        }


SPEC = MixerSpec(
    name="attention",
    aliases=("softmax_attention", "mha"),
    config=AttentionConfig,
    builder=SoftmaxAttention,
    summary="multi-head softmax attention (SDPA); the baseline",
    matrix_class="dense (softmax)",
    direction="either",
    complexity="O(L^2)",
    data_dependent="yes",
    stepping=True,
    test_options={"num_heads": 4},
)
