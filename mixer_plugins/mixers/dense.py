"""``dense``: a free L x L matrix per head (MLP-Mixer's token mixing) in the Hydra block.

``M = W_h`` with ``W`` a (heads, max_seq_len, max_seq_len) parameter (xavier-normal), applied as
``y = s M v + v`` with ``s = 1/sqrt(max_seq_len)``. Data-independent only: sequences up to ``max_seq_len``
use the leading block of W (a causal variant uses its lower triangle).

Decoding (causal) keeps every token's values; a step applies its rows of W.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import Tensor, nn

from ..registry.spec import MixerSpec
from .block import BlockConfig, BlockContext, ChannelGroup, MatrixMixerBlock
from .cache import MixerCache, kv_positions, kv_write

__all__ = ["DenseConfig", "DenseMixer", "SPEC"]


class DenseConfig(BlockConfig):
    """Options of the dense mixer (data-independent only)."""

    max_seq_len: int = Field(gt=0, description="size of the free L x L matrices; longer inputs are refused")
    causal: bool = Field(False, description="use only the lower triangle (j <= i)")


class DenseMixer(MatrixMixerBlock[BlockContext]):
    """A free (heads, max_seq_len, max_seq_len) matrix per head, applied as ``y = s W v + v``."""

    steppable = True
    max_seq_len: int  # the size of the free matrices, always set

    def __init__(self, config: DenseConfig):
        super().__init__(config, [ChannelGroup("v", config.d_inner)])
        self.max_seq_len = config.max_seq_len
        self.weight = nn.Parameter(torch.empty(self.num_heads, config.max_seq_len, config.max_seq_len))
        nn.init.xavier_normal_(self.weight)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.xavier_normal_(self.weight)

    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> BlockContext:
        return BlockContext(values=self.heads(parts["v"]), mask=mask)

    def matrix(self, ctx: BlockContext) -> Tensor:
        b, length = ctx.values.shape[:2]
        w = self.weight[:, :length, :length].to(ctx.values.dtype)
        if self.causal:
            w = torch.tril(w)
        return self.identity_plus(w, 1.0 / math.sqrt(self.max_seq_len))[None].expand(b, -1, -1, -1)

    def mix(self, ctx: BlockContext) -> Tensor:
        b, length = ctx.values.shape[:2]
        w = self.weight[:, :length, :length].to(ctx.values.dtype)
        if self.causal:
            w = torch.tril(w)
        return torch.einsum("hij,bjhp->bihp", w, ctx.values) / math.sqrt(self.max_seq_len) + ctx.values

    # -- decoding (causal) ----------------------------------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        super().init_cache(cache, batch, max_len, dtype, device)
        cache.state["v"] = torch.zeros(batch, max_len, self.num_heads, self.head_dim, dtype=dtype, device=device)

    def fill_cache(self, cache: MixerCache, ctx: BlockContext, x: Tensor, lengths: Tensor) -> Tensor:
        self.fill_conv_cache(cache, x, lengths)
        cache.state["v"][:, :ctx.values.shape[1]] = ctx.values.detach()
        return self.mix(ctx)

    def mix_step(self, ctx: BlockContext, cache: MixerCache) -> Tensor:
        v = ctx.values
        positions = cache.positions(v.shape[1])
        kv_write(cache.state["v"], v.detach(), positions)
        rows = self.weight[:, positions, :cache.max_len].to(v.dtype)                  # (h, b, t, J)
        rows = torch.where(kv_positions(positions, cache.max_len), rows, rows.new_zeros(()))
        return torch.einsum("hbtj,bjhp->bthp", rows, cache.read("v", v.dtype)) / math.sqrt(self.max_seq_len) + v

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        return {"apply": 2 * batch * self.num_heads * length * length * self.head_dim}


SPEC = MixerSpec(
    name="dense",
    aliases=("mlp_mixer",),
    config=DenseConfig,
    builder=DenseMixer,
    summary="free L x L matrix per head (MLP-Mixer token mixing), in the Hydra block",
    matrix_class="dense",
    direction="either",
    complexity="O(L^2)",
    data_dependent="no",
    stepping=True,
    test_options={"head_dim": 16, "max_seq_len": 40},
)
