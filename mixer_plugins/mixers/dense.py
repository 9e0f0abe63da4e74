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
from .block import BlockConfig, BlockContext, ChannelGroup
from .cache import MixerCache, kv_positions, kv_write
from .qk_block import SequenceMixerBlock

__all__ = ["DenseConfig", "DenseMixer", "SPEC"]


class DenseConfig(BlockConfig):
    """Options of the dense mixer (data-independent only)."""

    max_seq_len: int = Field(gt=0, description="size of the free L x L matrices; longer inputs are refused")
    causal: bool = Field(False, description="use only the lower triangle (j <= i)")


class DenseMixer(SequenceMixerBlock[BlockContext]):
    """A free (heads, max_seq_len, max_seq_len) matrix per head, applied as ``y = s W v + v``."""

    steppable = True
    max_seq_len: int  # the size of the free matrices, always set

    def __init__(self, config: DenseConfig):
        super().__init__(config, [ChannelGroup("v", config.d_inner)])
        self.max_seq_len = config.max_seq_len
        self.weight = self.free_parameter("weight", (self.num_heads, config.max_seq_len, config.max_seq_len),
                                          nn.init.xavier_normal_)

    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> BlockContext:
        return BlockContext(values=self.heads(parts["v"]), mask=mask)

    def _weight(self, ctx: BlockContext) -> Tensor:
        """W's leading block at the input's length (its lower triangle when causal), in the values' dtype."""
        length = ctx.values.shape[1]
        w = self.weight[:, :length, :length].to(ctx.values.dtype)
        return torch.tril(w) if self.causal else w

    def matrix(self, ctx: BlockContext) -> Tensor:
        w = self.identity_plus(self._weight(ctx), 1.0 / math.sqrt(self.max_seq_len))
        return w[None].expand(ctx.values.shape[0], -1, -1, -1)

    def mix(self, ctx: BlockContext) -> Tensor:
        return torch.einsum("hij,bjhp->bihp", self._weight(ctx), ctx.values) / math.sqrt(self.max_seq_len) + ctx.values

    # -- decoding (causal): every token's values ----------------------------------------------------------
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
