"""``sliding_window_attention``: softmax attention restricted to a window of nearby keys (the SWA baseline of
Kuang et al. 2025).

Query ``i`` sees keys ``i - window <= j <= i`` when causal (``window + 1`` keys, as in the paper's code) and
``|i - j| <= window`` when bidirectional. Same q/k/v projections and QK-LN as the structured mixers, logit scale
``1/sqrt(head_dim)`` by default (the paper's code uses ``8/head_dim``: ``logit_scaling="mup", logit_multiplier=8``).

The fast path is blocked: queries in chunks of ``window`` tokens, each chunk scoring only the keys of its neighbour
chunks, so time and memory are ``O(L * window)`` (about ``2-3 * window`` keys per query) instead of ``O(L^2)``; for
short sequences (or a window as long as the sequence) it falls back to dense scores.

Decoding (causal) keeps a ring of the last ``window + 1`` keys and values per row (with the position each slot
holds): constant memory and work per token, whatever the length.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from ..layers.masks import dense_allowed, masked_softmax
from ..registry.spec import MixerSpec
from ._softmax_common import (
    QKVSoftmaxConfig,
    QKVSoftmaxMixer,
    cached_attention,
    dot_scores,
    local_attention,
    local_attention_flops,
)
from .base import QKContext
from .cache import MixerCache, ring_write

__all__ = ["SlidingWindowAttention", "SlidingWindowAttentionConfig", "SPEC"]


class SlidingWindowAttentionConfig(QKVSoftmaxConfig):
    """Options of sliding-window attention."""

    window: int = Field(
        512, gt=0, description="keys within this distance are attended (causal: the window previous tokens and self)"
    )


class SlidingWindowAttention(QKVSoftmaxMixer):
    """Sliding-window softmax attention (blocked, ``O(L * window)``)."""

    def __init__(self, config: SlidingWindowAttentionConfig):
        super().__init__(config)
        self.window = config.window
        self.scale = config.logit_scale(self.head_dim)

    def mix(self, ctx: QKContext) -> Tensor:
        return local_attention(ctx.q, ctx.k, ctx.values, window=self.window, causal=self.causal, mask=ctx.mask,
                               scale=self.scale, guard=self.guard_nonfinite)

    def matrix(self, ctx: QKContext) -> Tensor:
        scores = dot_scores(ctx.q, ctx.k) * self.scale
        allowed = dense_allowed(ctx.mask, scores.shape[-1], self.causal, scores.device, window=self.window)
        return masked_softmax(scores, allowed)

    # -- decoding (causal): a ring of window + 1 slots -------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        size = self.window + 1
        shape = (batch, size, self.num_heads, self.head_dim)
        cache.state["k"] = torch.zeros(shape, dtype=dtype, device=device)
        cache.state["v"] = torch.zeros(shape, dtype=dtype, device=device)
        cache.state["pos"] = torch.full((batch, size), -1, dtype=torch.long, device=device)

    def fill_cache(self, cache: MixerCache, ctx: QKContext, x: Tensor, lengths: Tensor) -> Tensor:
        size = self.window + 1
        # each row's last `size` real tokens (positions < 0: empty slots), each into slot position % size
        positions = lengths[:, None] - size + torch.arange(size, device=lengths.device)
        filled = positions >= 0
        index = positions.clamp(min=0)[..., None, None].expand(-1, -1, self.num_heads, self.head_dim)
        for name, source in (("k", ctx.k), ("v", ctx.values)):
            ring_write(cache.state[name], source.detach().gather(1, index), positions)
        ring_write(cache.state["pos"], torch.where(filled, positions, -1), positions)
        return self.mix(ctx)

    def step_tokens(self, x: Tensor, cache: MixerCache) -> Tensor:
        """One token: its q/k/v, one write into the ring, one attention call over the ring, the output projection.
        Several tokens take the general path."""
        if x.shape[1] != 1:
            return super().step_tokens(x, cache)
        ctx = self.prepare(x, None)
        return self.finish(ctx, self._ring_step(ctx.q, ctx.k, ctx.values, cache.lengths.view(-1, 1), cache))

    def mix_step(self, ctx: QKContext, cache: MixerCache) -> Tensor:
        positions = cache.positions(ctx.values.shape[1])
        # token by token: each one's window is the ring after writing it
        return torch.cat([self._ring_step(ctx.q[:, i:i + 1], ctx.k[:, i:i + 1], ctx.values[:, i:i + 1],
                                          positions[:, i:i + 1], cache) for i in range(positions.shape[1])], dim=1)

    def _ring_step(self, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, cache: MixerCache) -> Tensor:
        """One token per row (at ``pos``, (batch, 1)): write its key and value into the ring, attend over the ring."""
        slot = pos % (self.window + 1)
        index = slot.view(-1, 1, 1, 1).expand(k.shape)
        for name, new in (("k", k), ("v", v)):
            ring = cache.state[name]
            ring.scatter_(1, index, new if new.dtype == ring.dtype else new.to(ring.dtype))
        held = cache.state["pos"].scatter_(1, slot, pos)
        allowed = held >= (pos - self.window).clamp_(min=0)                           # (b, size): held < 0 is empty
        return cached_attention(q, cache.read("k", q.dtype), cache.read("v", q.dtype), allowed[:, None], self.scale)

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        proj = self.projection_flops(batch, length)
        local = local_attention_flops(batch, self.num_heads, length, self.window, self.causal,
                                      self.head_dim, self.head_dim)
        return {"qkv_proj": proj["qkv_proj"], **local, "out_proj": proj["out_proj"]}


SPEC = MixerSpec(
    name="sliding_window_attention",
    aliases=("swa",),
    config=SlidingWindowAttentionConfig,
    builder=SlidingWindowAttention,
    summary="softmax attention over a sliding window of keys (baseline of Kuang et al. 2025)",
    matrix_class="banded (softmax)",
    direction="either",
    complexity="O(L w)",
    data_dependent="yes",
    stepping=True,
    test_options={"num_heads": 2, "window": 3},
)
