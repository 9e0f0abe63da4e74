"""The matrix-mixer block of the Hydra paper (Mamba-2 style), shared by the structured mixers.

    in_proj -> depthwise short conv (non-causal, kernel 7) -> activation -> matrix mixer
            -> gated RMSNorm (norm before gate, over the whole inner width) -> out_proj

Only the matrix changes between mixers. A mixer built on :class:`MatrixMixerBlock` passes the channel
groups its ``in_proj`` produces to the block's constructor and turns the per-token groups into values and
matrix generators (:meth:`~MatrixMixerBlock.build_context`); the block does the rest, including padding: with a mask,
pad positions are zeroed before the convolution (so they are neutral inputs, exactly like the conv's own
zero padding on the unpadded row) and again after the convolution and activation (the conv bias would
otherwise make them non-zero), so no scan direction ever reads a pad.

Decoding (causal block mixers that step) uses the base class's hooks: the short convolution keeps a rolling state of
its last ``d_conv`` inputs per channel (``cache.state["conv"]``, mamba-ssm's ``conv_state`` layout). The block's
:meth:`~MatrixMixerBlock.init_cache` allocates it and its :meth:`~MatrixMixerBlock.prepare_step` advances it; a mixer
adds its own state in ``init_cache`` (after ``super().init_cache``), fills both in ``fill_cache`` (calling
:meth:`~MatrixMixerBlock.fill_conv_cache`) and advances its own in ``mix_step``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar, Generic, Optional, TypeVar

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from ..kernels.conv.step import causal_conv1d_state, causal_conv1d_step
from ..kernels.decode import decode_unchecked
from ..layers.conv import ShortConv
from ..layers.norm import GatedRMSNorm
from ..registry.spec import MixerConfig
from .base import MatrixMixer, MixerContext
from .cache import MixerCache

__all__ = [
    "BlockConfig",
    "BlockContext",
    "DataIndependentOptions",
    "ChannelGroup",
    "MatrixMixerBlock",
]


class BlockConfig(MixerConfig):
    """Options of the shared block (the paper's defaults)."""

    #: Causal-only mixers (semiseparable) set this: their short convolution is causal, any kernel size.
    always_causal: ClassVar[bool] = False

    expand: int = Field(2, gt=0, description="inner width = expand * dim")
    head_dim: int = Field(64, gt=0, description="channels per head (P); heads = expand * dim / head_dim")
    d_conv: int = Field(7, gt=0, description="kernel size of the depthwise short convolution")
    conv_bias: bool = Field(True, description="bias in the short convolution")
    proj_bias: bool = Field(False, description="bias in in_proj and out_proj")
    norm_eps: float = Field(1e-5, gt=0, description="epsilon of the gated RMSNorm")
    norm_before_gate: bool = Field(
        True, description="gated RMSNorm order: norm(y) * silu(z) (Hydra) or norm(y * silu(z)) (Mamba-2)"
    )

    @property
    def d_inner(self) -> int:
        return self.expand * self.dim

    @property
    def num_heads(self) -> int:
        return self.d_inner // self.head_dim

    @model_validator(mode="after")
    def _check_block(self) -> BlockConfig:
        if self.d_inner % self.head_dim:
            raise ValueError(
                f"inner width expand*dim = {self.expand}*{self.dim} = {self.d_inner} is not divisible by "
                f"head_dim ({self.head_dim}); choose head_dim dividing {self.d_inner}"
            )
        if not (self.always_causal or getattr(self, "causal", False)) and self.d_conv % 2 == 0:
            raise ValueError(
                f"d_conv ({self.d_conv}) must be odd for a non-causal (centred) short convolution"
            )
        return self


class DataIndependentOptions(MixerConfig):
    """Mixin fields of mixers that have a data-independent (free L-sized parameters) form."""

    data_dependent: bool = Field(
        True, description="sequence-aligned matrix from per-token projections (True) or free L-sized parameters"
    )
    max_seq_len: Optional[int] = Field(
        None, gt=0, description="length covered by the free parameters; required when data_dependent=False "
        "(ignored otherwise)"
    )

    @model_validator(mode="after")
    def _check_max_len(self) -> DataIndependentOptions:
        if not self.data_dependent and self.max_seq_len is None:
            raise ValueError("the data-independent form (data_dependent=False) needs max_seq_len")
        return self

    @property
    def free_length(self) -> int:
        """``max_seq_len`` of the data-independent form (where the validator has made sure it is set)."""
        if self.max_seq_len is None:
            raise ValueError("the data-independent form (data_dependent=False) needs max_seq_len")
        return self.max_seq_len


@dataclasses.dataclass(frozen=True)
class ChannelGroup:
    """One slice of in_proj's output: ``width`` channels, optionally convolved and activated."""

    name: str
    width: int
    conv: bool = True
    activation: bool = True


@dataclasses.dataclass(eq=False, kw_only=True)
class BlockContext(MixerContext):
    """Context of a block mixer: ``z`` is the gate of the output norm (batch, length, out_width), set by the block;
    ``mlp`` the gated MLP branch ``silu(z0) * x0`` (batch, length, mlp_width) of a block built with one."""

    z: Tensor | None = None
    mlp: Tensor | None = None


#: The context type of a block mixer (:class:`BlockContext` or a subclass).
BlockCtxT = TypeVar("BlockCtxT", bound=BlockContext)


class _ShortConv(ShortConv):
    """:class:`ShortConv` whose weights are drawn ``U[-init_bound, init_bound]`` when ``init_bound`` is set (Mamba's
    ``conv_init``), at construction and on every ``reset_parameters`` (so a reset equals a fresh build)."""

    init_bound: Optional[float] = None

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = True, causal: bool = False,
                 init_bound: Optional[float] = None):
        super().__init__(channels, kernel_size, bias=bias, causal=causal)
        self.init_bound = init_bound
        if init_bound is not None:
            self._draw_bounded(init_bound)

    @torch.no_grad()
    def _draw_bounded(self, bound: float) -> None:
        nn.init.uniform_(self.weight, -bound, bound)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.init_bound is not None:
            self._draw_bounded(self.init_bound)


class MatrixMixerBlock(MatrixMixer[BlockCtxT], Generic[BlockCtxT]):
    """Base of the structured mixers: the shared block around a per-head L x L matrix.

    A subclass passes the channel ``groups`` its in_proj produces after ``z`` (convolved groups first) and implements
    :meth:`build_context`, :meth:`matrix` (and usually a fast :meth:`mix`) and :meth:`mixer_flops`; it derives from
    ``MatrixMixerBlock[ItsContext]`` (a :class:`BlockContext` subclass), the type its hooks take and return.
    ``ctx.values`` is the post-conv, post-activation value group reshaped to (batch, length, heads, head_dim).
    ``out_width`` (default ``d_inner``) is the width of the mixed values, the norm and out_proj's input
    (concat-style mixers produce twice ``d_inner``). ``mlp_width`` > 0 adds Mamba-2's gated MLP beside the mixer:
    in_proj also gives ``z0``, ``x0`` of that width (in front of ``z``), and out_proj reads ``[silu(z0) * x0, normed
    y]``. ``norm=False`` gates without the RMSNorm: ``y * silu(z)``.
    """

    def __init__(self, config: BlockConfig, groups: Sequence[ChannelGroup], *, causal_conv: bool | None = None,
                 out_width: int | None = None, mlp_width: int = 0, norm: bool = True):
        super().__init__(config)
        self.d_inner = config.d_inner
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads
        self.causal_conv = self.causal if causal_conv is None else causal_conv
        groups = list(groups)
        names = [g.name for g in groups]
        if len(set(names)) != len(names) or "z" in names:
            raise ValueError(f"channel group names must be unique and not 'z': {names}")
        self.groups = groups
        n_conv = sum(1 for g in groups if g.conv)
        if any(not g.conv for g in groups[:n_conv]):
            raise ValueError(
                f"{type(self).__name__}: the convolved channel groups must come first, got "
                f"{[(g.name, g.conv) for g in groups]}"
            )
        self._conv_groups = groups[:n_conv]
        self._conv_all_activated = all(g.activation for g in self._conv_groups)
        self.out_width = out_width or self.d_inner
        self.mlp_width = mlp_width
        # in_proj's output split as (z0, x0,) z, the convolved slice, the other groups
        self._step_widths = [mlp_width, mlp_width] if mlp_width else []
        self._step_widths += [self.out_width, sum(g.width for g in self._conv_groups)]
        self._step_widths += [g.width for g in groups[n_conv:]]
        self.in_proj = nn.Linear(config.dim, sum(self._step_widths), bias=config.proj_bias)
        conv_width = sum(g.width for g in groups if g.conv)
        self.conv1d = (
            _ShortConv(conv_width, config.d_conv, bias=config.conv_bias, causal=self.causal_conv,
                       init_bound=getattr(config, "conv_init", None))
            if conv_width else None
        )
        # Mamba-2 with ngroups > 1 normalises each group of out_width / ngroups channels on its own.
        norm_groups = int(getattr(config, "ngroups", 1)) if getattr(config, "norm_per_group", False) else 1
        self.norm = (GatedRMSNorm(self.out_width, config.norm_eps, config.norm_before_gate, norm_groups) if norm
                     else None)
        self.out_proj = nn.Linear(mlp_width + self.out_width, config.dim, bias=config.proj_bias)

    # -- hooks (called per forward, never from the constructor) --------------------------------------
    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> BlockCtxT:
        """Per-token groups (batch, length, width) -> context with values (batch, length, heads, head_dim)."""
        raise NotImplementedError

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        """FLOPs of the mixer core (the matrix product and whatever builds it)."""
        raise NotImplementedError

    # -- the block ------------------------------------------------------------------------------------
    def prepare(self, x: Tensor, mask: Tensor | None) -> BlockCtxT:
        other = self.groups[len(self._conv_groups):]
        # in_proj as one product, its output split into views (z, the convolved slice, the other groups): one
        # matmul each way and one for the weight's gradient; the kernels below read the views through their strides
        mlp, (z, u, *rest) = self._in_proj_pieces(x)
        keep = mask[..., None].to(x.dtype) if mask is not None else None
        pieces: dict[str, Tensor] = {}
        if self.conv1d is not None:   # there are convolved groups (their conv exists exactly then)
            # the convolved groups lead in_proj's output: convolve them as one slice (no copy to gather them)
            if keep is not None:
                u = u * keep          # pads are neutral inputs, like the conv's zero padding
            u = self.conv1d(u, silu=self._conv_all_activated)
            if keep is not None:
                u = u * keep          # the conv bias made the pads non-zero again
            pieces.update(zip([g.name for g in self._conv_groups],
                              u.split([g.width for g in self._conv_groups], dim=-1)))
        pieces.update(zip([g.name for g in other], rest))
        for g in self.groups:
            if g.activation and not (g.conv and self._conv_all_activated):
                pieces[g.name] = F.silu(pieces[g.name])
                if keep is not None:
                    pieces[g.name] = pieces[g.name] * keep
        ctx = self.build_context(pieces, mask)
        ctx.z, ctx.mlp = z, mlp
        return ctx

    def finish(self, ctx: BlockCtxT, y: Tensor) -> Tensor:
        assert ctx.z is not None, "the block's prepare sets the gate ctx.z"
        y = self.gated_norm(y.flatten(2), ctx.z)
        if ctx.mlp is not None:
            y = torch.cat([ctx.mlp, y], dim=-1)
        return self.out_proj(y)

    def gated_norm(self, y: Tensor, z: Tensor) -> Tensor:
        """The gated RMSNorm of (batch, length, out_width) ``y`` gated by ``z`` (over the whole width, or per group:
        ``norm_per_group``); without a norm, the gate alone."""
        return y * F.silu(z) if self.norm is None else self.norm(y, z)

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        tokens = batch * length
        parts = {"in_proj": 2 * tokens * self.dim * self.in_proj.out_features}
        if self.conv1d is not None:
            parts["conv"] = 2 * tokens * self.conv1d.in_channels * self.conv1d.kernel_size[0]
        parts.update(self.mixer_flops(batch, length))
        parts["out_proj"] = 2 * tokens * (self.mlp_width + self.out_width) * self.dim
        return parts

    # -- decoding (causal block mixers): the short convolution's state -----------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        """The short convolution's state ``cache.state["conv"]``; a mixer adds its own after ``super().init_cache``."""
        if self.conv1d is not None:
            cache.state["conv"] = torch.zeros(batch, self.conv1d.in_channels, self.conv1d.kernel_size[0],
                                              dtype=dtype, device=device)

    def _in_proj_pieces(self, x: Tensor) -> tuple[Tensor | None, list[Tensor]]:
        """in_proj of ``x``: the MLP branch ``silu(z0) * x0`` (None without one) and the list ``z``, the convolved
        slice, the other groups."""
        pieces = list(F.linear(x, self.in_proj.weight, self.in_proj.bias).split(self._step_widths, dim=-1))
        if not self.mlp_width:
            return None, pieces
        return F.silu(pieces[0]) * pieces[1], pieces[2:]

    def fused_ssd_step(self, x: Tensor, cache: MixerCache, state: str, *, A_log: Tensor | None,
                       D: Tensor | float | None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
                       dt_limit: tuple[float, float] = (0.0, math.inf), bc_order: str = "BC",
                       scale: float = 1.0) -> Tensor | None:
        """One token (batch, 1, dim) through the whole block with :func:`~mixer_plugins.kernels.decode.ssd_decode_step`
        (the short convolution's and the SSD state's updates in one op), for mixers whose convolved groups are the
        scan's ``x | B | C`` (all activated) and whose only other group is the raw step sizes (formed by the op with
        ``dt_bias``/``dt_softplus``/``dt_limit``) or none (no step sizes). ``A = -exp(A_log)`` (None: no decay).

        Returns None where the cache's states are narrower than the input (the general path then computes in the
        wider dtype and rounds only what it stores). The ops run without their argument checks (the block built
        every shape), since at one token those checks would cost as much as the state update."""
        conv, ssm = cache.state["conv"], cache.state[state]
        if ssm.dtype != x.dtype and ssm.dtype.itemsize <= x.dtype.itemsize:
            return None
        b = x.shape[0]
        in_proj, conv1d, norm, mlp_width = self.in_proj, self.conv1d, self.norm, self.mlp_width
        assert conv1d is not None and self._conv_all_activated, "a block whose convolved groups are x | B | C"
        pieces = F.linear(x.view(b, -1), in_proj.weight, in_proj.bias).split_with_sizes(self._step_widths, dim=-1)
        z, xbc, *dt = pieces[2:] if mlp_width else pieces
        # one norm over the row: the step op applies it itself
        fused = (z, norm.weight, norm.eps, norm.norm_before_gate) if norm is not None and norm.groups == 1 else None
        normed = decode_unchecked(xbc, conv, conv1d.weight, conv1d.bias, ssm, dt[0] if dt else None, A_log, D,
                                  bc_order, dt_bias, dt_softplus, dt_limit, scale, True, fused, None)
        if fused is None:
            normed = self.gated_norm(normed, z)
        if mlp_width:
            normed = torch.cat([F.silu(pieces[0]) * pieces[1], normed], dim=-1)
        out_proj = self.out_proj
        return F.linear(normed, out_proj.weight, out_proj.bias).view(b, 1, -1)

    def fill_conv_cache(self, cache: MixerCache, x: Tensor, lengths: Tensor) -> None:
        """Prefill of the short convolution's state from the prompt ``x``: the convolution's inputs at each row's last
        ``d_conv`` real tokens (zeros before the row's start). A mixer's :meth:`fill_cache` calls it."""
        if self.conv1d is None:
            return
        kernel = self.conv1d.kernel_size[0]
        tail = causal_conv1d_state(x, kernel, lengths).transpose(1, 2)          # (b, kernel, dim)
        start = 2 * self.mlp_width + self.out_width
        rows = slice(start, start + self.conv1d.in_channels)
        bias = None if self.in_proj.bias is None else self.in_proj.bias[rows]
        u = F.linear(tail, self.in_proj.weight[rows], bias)
        started = (lengths[:, None] - kernel + torch.arange(kernel, device=x.device)) >= 0
        u = torch.where(started[..., None], u, u.new_zeros(()))
        cache.state["conv"].copy_(u.transpose(1, 2).detach())

    def prepare_step(self, x: Tensor, cache: MixerCache) -> BlockCtxT:
        """The block's step: in_proj, the short convolution against its state (updated in place), the mixer's
        context. A mixer whose context depends on the position (free, L-sized parameters) extends it."""
        mlp, (z, u, *rest) = self._in_proj_pieces(x)
        pieces: dict[str, Tensor] = {}
        if self.conv1d is not None:
            # the convolution runs in the wider of the state's and the inputs' dtypes
            tail = cache.read("conv", torch.promote_types(cache.state["conv"].dtype, u.dtype))
            u, state = causal_conv1d_step(u, tail, self.conv1d.weight[:, 0, :], self.conv1d.bias,
                                          silu=self._conv_all_activated)
            cache.state["conv"].copy_(state.detach())
            pieces.update(zip([g.name for g in self._conv_groups],
                              u.split([g.width for g in self._conv_groups], dim=-1)))
        pieces.update(zip([g.name for g in self.groups[len(self._conv_groups):]], rest))
        for g in self.groups:
            if g.activation and not (g.conv and self._conv_all_activated):
                pieces[g.name] = F.silu(pieces[g.name])
        ctx = self.build_context(pieces, None)
        ctx.z, ctx.mlp = z, mlp
        return ctx

    # -- helpers for subclasses -------------------------------------------------------------------
    def heads(self, t: Tensor) -> Tensor:
        """(batch, length, heads * k) -> (batch, length, heads, k)."""
        return t.unflatten(-1, (self.num_heads, -1))

    def identity_plus(self, matrix: Tensor, scale: float) -> Tensor:
        """``scale * M + I``: the einsum mixers of the paper add their own input (the residual term)."""
        eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
        return scale * matrix + eye

    def length_prefix(self, param: Tensor, length: int, dim: int = 0) -> Tensor:
        """The first ``length`` positions of an L-sized parameter (data-independent mixers)."""
        return param.narrow(dim, 0, length)
