"""Common machinery of the sequence block mixers (Toeplitz, dense, and those built from per-position queries and keys).

:class:`SequenceMixerBlock` carries their free parameters and their decoding cache of every token's values.
Vandermonde, Cauchy, low-rank and the block's softmax attention (:class:`QKMixerBlock`) all have the same two forms:

* data-dependent (sequence-aligned): q_i, k_i in R^{heads x qk_dim} come from token i through in_proj and
  the short convolution, so the mixer runs at any length;
* data-independent: Q, K are free (max_seq_len, heads, qk_dim) parameters; lengths up to max_seq_len use
  their leading rows.

The output is ``y = s * M v + v`` (the paper's einsum mixers add their own input), so the matrix they
apply to their values is ``s * M + I``; subclasses give ``M`` (:meth:`QKMixerBlock.qk_matrix`) and ``s``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from .block import BlockConfig, BlockContext, BlockCtxT, ChannelGroup, DataIndependentOptions, MatrixMixerBlock
from .cache import MixerCache, kv_positions, kv_write

__all__ = ["BlockQKContext", "QKBlockConfig", "QKMixerBlock", "SequenceBlockConfig", "SequenceMixerBlock",
           "queries_and_keys"]


@dataclasses.dataclass(eq=False, kw_only=True)
class BlockQKContext(BlockContext):
    """Context of the block mixers scored by queries and keys (``q``, ``k``: (batch|1, length, heads, qk_dim)); both
    are None for a form without them (the Vandermonde mixer's DFT)."""

    q: Tensor | None = None
    k: Tensor | None = None


def queries_and_keys(q: Tensor | None, k: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(q, k)`` of a block mixer whose every form has queries and keys (all but the Vandermonde mixer)."""
    if q is None or k is None:
        raise RuntimeError("this mixer has no queries and keys in its current form")
    return q, k


class SequenceBlockConfig(BlockConfig, DataIndependentOptions):
    """Block options shared by the mixers with a data-dependent and a data-independent form."""

    scale_length: int = Field(
        128, gt=0, description="L in the output scale 1/sqrt(L ...) of the data-dependent form; fixed (not the "
        "input length) so outputs do not depend on padding and the mixer extends to any length"
    )
    causal: bool = Field(False, description="keep only j <= i (lower-triangular matrix, causal short conv)")


class QKBlockConfig(SequenceBlockConfig):
    """Options of the block mixers scored by per-head queries and keys."""

    qk_dim: int = Field(16, gt=0, description="width of the per-head query/key vectors")


class SequenceMixerBlock(MatrixMixerBlock[BlockCtxT]):
    """Base of the sequence block mixers: the forms of a :class:`SequenceBlockConfig` (``data_dependent``,
    ``max_seq_len``, ``norm_length``), free parameters (:meth:`free_parameter`) and, for decoding, every token's
    values ``state["v"]``."""

    def __init__(self, config: BlockConfig, groups: Sequence[ChannelGroup]):
        super().__init__(config, groups)
        self._free_inits: dict[str, Callable[[Tensor], object]] = {}
        if isinstance(config, SequenceBlockConfig):
            self.data_dependent = config.data_dependent
            self.max_seq_len = None if config.data_dependent else config.max_seq_len
            #: The L of the paper's 1/sqrt(L ...) output scales (max_seq_len in the data-independent form).
            self.norm_length = config.scale_length if config.data_dependent else config.free_length

    def free_parameter(self, name: str, shape: tuple[int, ...], init: Callable[[Tensor], object]) -> nn.Parameter:
        """A new parameter ``name`` drawn in place by ``init``, here and (in the same order) by reset_parameters."""
        param = nn.Parameter(torch.empty(shape))
        with torch.no_grad():
            init(param)
        setattr(self, name, param)
        self._free_inits[name] = init
        return param

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        for name, init in self._free_inits.items():
            init(getattr(self, name))

    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        super().init_cache(cache, batch, max_len, dtype, device)
        cache.state["v"] = torch.zeros(batch, max_len, self.num_heads, self.head_dim, dtype=dtype, device=device)

    def fill_cache(self, cache: MixerCache, ctx: BlockCtxT, x: Tensor, lengths: Tensor) -> Tensor:
        self.fill_conv_cache(cache, x, lengths)
        cache.state["v"][:, :ctx.values.shape[1]] = ctx.values.detach()
        return self.mix(ctx)


def qk_groups(config: QKBlockConfig, qk_activation: bool) -> list[ChannelGroup]:
    """in_proj's groups after ``z``: the values, then (data-dependent form) the queries and keys, all convolved."""
    groups = [ChannelGroup("v", config.d_inner, conv=True, activation=True)]
    if config.data_dependent:
        width = config.num_heads * config.qk_dim
        groups += [
            ChannelGroup("q", width, conv=True, activation=qk_activation),
            ChannelGroup("k", width, conv=True, activation=qk_activation),
        ]
    return groups


class QKMixerBlock(SequenceMixerBlock[BlockQKContext]):
    """Block mixer with ``M = f(q, k)`` per head; subclasses define ``qk_matrix`` and ``output_scale``.

    ``free_qk``: whether the data-independent form has free Q/K parameters (the DFT form of Vandermonde has none);
    ``free_qk_init`` initialises them in place (default xavier-normal).
    """

    #: Whether the data-dependent q and k pass through SiLU after the convolution (low-rank: yes).
    qk_activation: ClassVar[bool] = False

    def __init__(self, config: QKBlockConfig, *, free_qk: bool = True,
                 free_qk_init: Callable[[Tensor], object] = nn.init.xavier_normal_):
        super().__init__(config, qk_groups(config, self.qk_activation))
        self.qk_dim = config.qk_dim
        self.free_qk = free_qk and not config.data_dependent
        self.q_param: nn.Parameter | None = None
        self.k_param: nn.Parameter | None = None
        if self.free_qk:
            shape = (config.free_length, self.num_heads, config.qk_dim)
            self.q_param = self.free_parameter("q_param", shape, free_qk_init)
            self.k_param = self.free_parameter("k_param", shape, free_qk_init)

    # -- hooks ----------------------------------------------------------------------------------------
    def qk_matrix(self, q: Tensor | None, k: Tensor | None, ctx: BlockQKContext) -> Tensor:
        """(b|1, L, h, qk) queries and keys -> (b|1, h, L, L) matrix M (before scale and identity)."""
        raise NotImplementedError

    def output_scale(self) -> float:
        """``s`` in ``y = s M v + v``."""
        raise NotImplementedError

    # -- block hooks ----------------------------------------------------------------------------------
    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> BlockQKContext:
        values = self.heads(parts["v"])
        length = values.shape[1]
        q: Tensor | None
        k: Tensor | None
        if self.data_dependent:
            q, k = self.heads(parts["q"]), self.heads(parts["k"])
        elif self.q_param is not None and self.k_param is not None:  # the free form
            q = self.length_prefix(self.q_param, length)[None].to(values.dtype)
            k = self.length_prefix(self.k_param, length)[None].to(values.dtype)
        else:
            q = k = None
        return BlockQKContext(values=values, mask=mask, q=q, k=k)

    def prepare_step(self, x: Tensor, cache: MixerCache) -> BlockQKContext:
        """A step's free queries and keys are the parameters' rows at the new tokens' positions."""
        ctx = super().prepare_step(x, cache)
        if self.q_param is not None and self.k_param is not None:  # the free form
            positions = cache.positions(ctx.values.shape[1])
            ctx.q = self.q_param[positions].to(ctx.values.dtype)
            ctx.k = self.k_param[positions].to(ctx.values.dtype)
        return ctx

    def matrix(self, ctx: BlockQKContext) -> Tensor:
        matrix = self.qk_matrix(ctx.q, ctx.k, ctx)
        if self.causal:
            matrix = torch.tril(matrix)
        return self.identity_plus(matrix.expand(ctx.values.shape[0], -1, -1, -1), self.output_scale())

    # -- decoding (causal): a cache of keys and values, rows of M against it ---------------------------
    def qk_rows(self, q: Tensor | None, keys: Tensor | None, positions: Tensor, max_len: int) -> Tensor:
        """Rows ``positions`` (batch, t) of M against key slots ``0 .. max_len-1``: (batch|1, heads, t, max_len)
        (before scale, identity and the causal mask). ``q`` (batch, t, heads, qk_dim) and ``keys`` (batch,
        max_len, heads, qk_dim) are None for a mixer without queries and keys (the DFT)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement qk_rows")

    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        super().init_cache(cache, batch, max_len, dtype, device)
        if self.data_dependent or self.free_qk:
            cache.state["k"] = torch.zeros(batch, max_len, self.num_heads, self.qk_dim, dtype=dtype, device=device)

    def fill_cache(self, cache: MixerCache, ctx: BlockQKContext, x: Tensor, lengths: Tensor) -> Tensor:
        if ctx.k is not None:  # the cache holds keys
            cache.state["k"][:, :ctx.k.shape[1]] = ctx.k.expand(ctx.values.shape[0], -1, -1, -1).detach()
        return super().fill_cache(cache, ctx, x, lengths)

    def mix_step(self, ctx: BlockQKContext, cache: MixerCache) -> Tensor:
        v = ctx.values
        b, t = v.shape[:2]
        positions = cache.positions(t)
        keys = None
        if ctx.k is not None:  # the cache holds keys
            kv_write(cache.state["k"], ctx.k.expand(b, -1, -1, -1), positions)   # (a step records no history)
            keys = cache.read("k", v.dtype)
        kv_write(cache.state["v"], v, positions)
        q = None if ctx.q is None else ctx.q.expand(b, -1, -1, -1)
        rows = self.qk_rows(q, keys, positions, cache.max_len)
        rows = torch.where(kv_positions(positions, cache.max_len)[:, None], rows, rows.new_zeros(()))
        return self.output_scale() * torch.einsum("bhtj,bjhp->bthp", rows, cache.read("v", v.dtype)) + v

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        # materialized: build M (about 2 * qk_dim multiply-adds per entry) and apply it to the values
        pairs = batch * self.num_heads * length * length
        return {"matrix": 2 * pairs * self.qk_dim, "apply": 2 * pairs * self.head_dim}
