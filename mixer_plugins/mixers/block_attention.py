"""``block_attention``: softmax attention as the matrix of the Hydra block (the paper's Table 2 row).

Per head ``M_ij = softmax_j(<q_i, k_j> / sqrt(qk_dim))``, applied as ``y = M v + v`` inside the block
(in_proj, short conv, SiLU on v only, gated RMSNorm, out_proj). Data-independent form: free
(max_seq_len, heads, qk_dim) Q, K — the form the released code meant but could not run (its einsum
mislabelled the length axis as heads). Named ``block_attention`` so it does not clash with the plain
``attention`` mixer (standard multi-head attention).

Decoding (causal) keeps the keys and values of every token (a KV cache of ``max_len`` slots) and the short
convolution's last inputs; a step scores its queries against the cache (slots past each row's position masked).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layers.masks import attention_bias_mask
from ..registry.spec import MixerSpec
from .cache import MixerCache, kv_positions, kv_write
from .qk_block import BlockQKContext, QKBlockConfig, QKMixerBlock, queries_and_keys

__all__ = ["BlockAttentionConfig", "BlockAttentionMixer", "SPEC"]


class BlockAttentionConfig(QKBlockConfig):
    """Options of softmax attention in the block."""


class BlockAttentionMixer(QKMixerBlock):
    """Softmax attention ``y = softmax(q k^T / sqrt(qk_dim)) v + v`` inside the Hydra block (SDPA fast path)."""

    steppable = True

    def output_scale(self) -> float:
        return 1.0

    def _allowed(self, ctx: BlockQKContext, length: int) -> Tensor | None:
        return attention_bias_mask(ctx.mask, length, self.causal, ctx.values.device)

    def raw_matrix(self, ctx: BlockQKContext) -> Tensor:
        b, length = ctx.values.shape[:2]
        scores = torch.einsum("bihd,bjhd->bhij", *queries_and_keys(ctx.q, ctx.k)) / math.sqrt(self.qk_dim)
        allowed = self._allowed(ctx, length)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return scores.softmax(-1).expand(b, -1, -1, -1)

    def mix(self, ctx: BlockQKContext) -> Tensor:
        v = ctx.values
        b, length = v.shape[:2]
        q, k = queries_and_keys(ctx.q, ctx.k)
        q, k = q.expand(b, -1, -1, -1).transpose(1, 2), k.expand(b, -1, -1, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2),
            attn_mask=self._allowed(ctx, length) if ctx.mask is not None else None,
            is_causal=self.causal and ctx.mask is None,
            scale=1.0 / math.sqrt(self.qk_dim),
        )
        return y.transpose(1, 2) + v

    # -- decoding (causal) ----------------------------------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        super().init_cache(cache, batch, max_len, dtype, device)
        cache.state["k"] = torch.zeros(batch, max_len, self.num_heads, self.qk_dim, dtype=dtype, device=device)
        cache.state["v"] = torch.zeros(batch, max_len, self.num_heads, self.head_dim, dtype=dtype, device=device)

    def fill_cache(self, cache: MixerCache, ctx: BlockQKContext, x: Tensor, lengths: Tensor) -> Tensor:
        self.fill_conv_cache(cache, x, lengths)
        b, length = ctx.values.shape[:2]
        _, k = queries_and_keys(ctx.q, ctx.k)
        cache.state["k"][:, :length] = k.expand(b, -1, -1, -1).detach()
        cache.state["v"][:, :length] = ctx.values.detach()
        return self.mix(ctx)

    def mix_step(self, ctx: BlockQKContext, cache: MixerCache) -> Tensor:
        v = ctx.values
        b, t = v.shape[:2]
        positions = cache.positions(t)
        q, k = queries_and_keys(ctx.q, ctx.k)
        kv_write(cache.state["k"], k.expand(b, -1, -1, -1), positions)   # (a step records no history)
        kv_write(cache.state["v"], v, positions)
        allowed = kv_positions(positions, cache.max_len)[:, None]                 # (b, 1, t, max_len)
        y = F.scaled_dot_product_attention(
            q.expand(b, -1, -1, -1).transpose(1, 2), cache.read("k", q.dtype).transpose(1, 2),
            cache.read("v", q.dtype).transpose(1, 2), attn_mask=allowed, scale=1.0 / math.sqrt(self.qk_dim),
        )
        return y.transpose(1, 2) + v


SPEC = MixerSpec(
    name="block_attention",
    config=BlockAttentionConfig,
    builder=BlockAttentionMixer,
    summary="softmax attention as the matrix of the Hydra block (Table 2's attention row)",
    matrix_class="dense (softmax)",
    direction="either",
    complexity="O(L^2)",
    data_dependent="option",
    stepping=True,
    test_options={"head_dim": 16, "qk_dim": 4},
)
