"""``block_attention``: softmax attention as the matrix of the Hydra block (the paper's Table 2 row).

Per head ``M_ij = softmax_j(<q_i, k_j> / sqrt(qk_dim))``, applied as ``y = M v + v`` inside the block
(in_proj, short conv, SiLU on v only, gated RMSNorm, out_proj). Data-independent form: free
(max_seq_len, heads, qk_dim) Q, K — the form the released code meant but could not run (its einsum
mislabelled the length axis as heads). Named ``block_attention`` so it does not clash with the plain
``attention`` mixer (standard multi-head attention).

Decoding (causal) keeps the keys and values of every token and the short convolution's last inputs; a step computes
its rows of the softmax against the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layers.masks import attention_bias_mask, masked_softmax
from ..registry.spec import MixerSpec
from .cache import kv_positions
from .qk_block import BlockQKContext, QKBlockConfig, QKMixerBlock, queries_and_keys

__all__ = ["BlockAttentionConfig", "BlockAttentionMixer", "SPEC"]


class BlockAttentionConfig(QKBlockConfig):
    """Options of softmax attention in the block."""


class BlockAttentionMixer(QKMixerBlock):
    """Softmax attention ``y = softmax(q k^T / sqrt(qk_dim)) v + v`` inside the Hydra block (SDPA fast path)."""

    steppable = True

    def output_scale(self) -> float:
        return 1.0

    def qk_matrix(self, q: Tensor | None, k: Tensor | None, ctx: BlockQKContext) -> Tensor:
        q, k = queries_and_keys(q, k)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(self.qk_dim)
        return masked_softmax(scores, attention_bias_mask(ctx.mask, scores.shape[-1], self.causal, scores.device))

    def qk_rows(self, q: Tensor | None, keys: Tensor | None, positions: Tensor, max_len: int) -> Tensor:
        q, keys = queries_and_keys(q, keys)
        scores = torch.einsum("bthd,bjhd->bhtj", q, keys) / math.sqrt(self.qk_dim)
        return masked_softmax(scores, kv_positions(positions, max_len)[:, None])

    def mix(self, ctx: BlockQKContext) -> Tensor:
        v = ctx.values
        b, length = v.shape[:2]
        q, k = queries_and_keys(ctx.q, ctx.k)
        q, k = q.expand(b, -1, -1, -1).transpose(1, 2), k.expand(b, -1, -1, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2),
            attn_mask=attention_bias_mask(ctx.mask, length, self.causal, v.device) if ctx.mask is not None else None,
            is_causal=self.causal and ctx.mask is None,
            scale=1.0 / math.sqrt(self.qk_dim),
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
