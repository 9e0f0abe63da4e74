"""``quasiseparable`` (aliases ``quasi``, ``hydra``): Hydra, the quasiseparable matrix mixer.

Per head the matrix is quasiseparable (Hydra, Eq. 3 / Prop. 3.7):

* below the diagonal ``m_ij = C_{f,i-1}.B_{f,j} exp(A sum_{k=j+1..i-1} dt^f_k) dt^f_j`` (shifted forward SSD),
* above it ``m_ij = C_{b,i+1}.B_{b,j} exp(A sum_{k=i+1..j-1} dt^b_k) dt^b_j`` (shifted backward SSD),
* on it the free, data-dependent ``delta_i = D + W_D x_i``,

computed in O(L) by :func:`mixer_plugins.kernels.quasiseparable` (one pass for both directions, no
flipped copies). Two forms of the generators:

* ``shared_bc=False`` (default): the Hydra module, separate B_f, C_f, B_b, C_b and dt_f, dt_b per token;
* ``shared_bc=True``: the paper's QS matrix mixer, one B, C for both directions (separate dt).

``data_dependent=False`` gives the data-independent QS mixer: B, C are a free (max_seq_len, 2 g N)
parameter, dt is the constant ``softplus(dt_bias)`` (a time-invariant decay), and, as in the released code,
the diagonal stays data-dependent.

The bidirectional heuristics and the QS ablations (:mod:`.bidirectional_ablations`) share this block and
differ only in how the two directions are combined.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from ..kernels import directional_scan, quasiseparable, scan_matrix
from ..kernels.custom_ops import chunked_scan_flops
from ..errors import NotMaterializableError
from ..registry.spec import MixerSpec
from .base import MixerContext
from .block import BlockConfig, ChannelGroup, DataIndependentOptions, MatrixMixerBlock

__all__ = [
    "SSMBlockConfig",
    "BidirectionalConfig",
    "QuasiseparableConfig",
    "BidirectionalSSMBlock",
    "QuasiseparableMixer",
    "init_dt_bias",
    "SPEC",
]


class SSMBlockConfig(BlockConfig):
    """Options of every SSM-generated mixer (semiseparable, quasiseparable and the ablations)."""

    d_state: int = Field(64, gt=0, description="state size N of each group")
    ngroups: int = Field(1, gt=0, description="groups of heads sharing B and C")
    chunk_size: int = Field(64, gt=0, description="chunk length of the chunked scan (speed/memory trade-off only)")
    dt_min: float = Field(1e-3, gt=0, description="initial step sizes are log-uniform in [dt_min, dt_max]")
    dt_max: float = Field(1e-1, gt=0, description="initial step sizes are log-uniform in [dt_min, dt_max]")
    dt_init_floor: float = Field(1e-4, gt=0, description="lower clamp of the initial step sizes")
    A_init_range: tuple[float, float] = Field(
        (1.0, 1.0), description="A = -U[lo, hi] per head at init (Hydra: -1; Mamba-2: [1, 16])"
    )

    @model_validator(mode="after")
    def _check_ssm(self) -> SSMBlockConfig:
        if self.num_heads % self.ngroups:
            raise ValueError(f"heads ({self.num_heads} = expand*dim/headdim) must be a multiple of ngroups "
                             f"({self.ngroups})")
        if not self.dt_min <= self.dt_max:
            raise ValueError(f"dt_min ({self.dt_min}) must not exceed dt_max ({self.dt_max})")
        lo, hi = self.A_init_range
        if not 0 < lo <= hi:
            raise ValueError(f"A_init_range must satisfy 0 < lo <= hi, got {self.A_init_range}")
        return self


class BidirectionalConfig(SSMBlockConfig):
    pass


class QuasiseparableConfig(BidirectionalConfig, DataIndependentOptions):
    shared_bc: bool = Field(
        False, description="one B, C for both directions (the paper's QS mixer) instead of Hydra's separate ones"
    )


def init_dt_bias(heads: int, dt_min: float, dt_max: float, floor: float) -> Tensor:
    """Inverse softplus of step sizes drawn log-uniformly in [dt_min, dt_max] (Mamba-2's initialisation)."""
    dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


class SSMParameters(nn.Module):
    """A (through A_log), dt_bias and, optionally, the diagonal skip D, per head."""

    def __init__(self, heads: int, config: SSMBlockConfig, *, with_d: bool):
        super().__init__()
        lo, hi = config.A_init_range
        self.A_log = nn.Parameter(torch.log(torch.empty(heads).uniform_(lo, hi)))
        self.dt_bias = nn.Parameter(init_dt_bias(heads, config.dt_min, config.dt_max, config.dt_init_floor))
        self.D = nn.Parameter(torch.ones(heads)) if with_d else None

    def A(self, dtype: torch.dtype) -> Tensor:
        return -torch.exp(self.A_log.to(dtype))

    def delta(self, dt: Tensor) -> Tensor:
        return nn.functional.softplus(dt + self.dt_bias.to(dt.dtype))


class BidirectionalSSMBlock(MatrixMixerBlock):
    """Hydra's block layout with a configurable combination of the two scan directions.

    Class switches (set by each mixer): ``shift`` (move each direction one step off the diagonal),
    ``use_diag`` (add the data-dependent diagonal ``D + W_D x``) and ``combine`` ("sum", "product" or
    "concat" of the two directions).
    """

    shift: ClassVar[bool] = True
    use_diag: ClassVar[bool] = True
    combine: ClassVar[Literal["sum", "product", "concat"]] = "sum"

    def __init__(self, config: BidirectionalConfig):
        self.shared_bc = bool(getattr(config, "shared_bc", False))
        self.data_dependent = bool(getattr(config, "data_dependent", True))
        self.d_state = config.d_state
        self.ngroups = config.ngroups
        self.chunk_size = config.chunk_size
        width = 2 * config.d_inner if self.combine == "concat" else None
        super().__init__(config, out_width=width)
        if self.combine == "concat":
            self.num_heads = 2 * config.num_heads  # the matrix has a forward and a backward block of heads
        heads = config.num_heads
        self.ssm = SSMParameters(heads, config, with_d=self.use_diag)
        self.fc_D = nn.Linear(self.d_inner, heads, bias=False) if self.use_diag else None
        self.max_seq_len = None
        if not self.data_dependent:
            self.max_seq_len = config.max_seq_len
            self.BC = nn.Parameter(torch.empty(config.max_seq_len, 2 * self.ngroups * self.d_state))
            nn.init.xavier_normal_(self.BC)
        self.materializable = self.combine != "product"

    # -- layout ---------------------------------------------------------------------------------------
    def channel_groups(self) -> list[ChannelGroup]:
        gn = self.ngroups * self.d_state
        heads = self.config.num_heads
        groups = [ChannelGroup("x", self.d_inner)]
        if not self.data_dependent:
            return groups
        if self.shared_bc:
            groups += [ChannelGroup("B", gn), ChannelGroup("C", gn)]
        else:
            groups += [ChannelGroup(n, gn) for n in ("B_f", "C_f", "B_b", "C_b")]
        groups.append(ChannelGroup("dt", 2 * heads, conv=False, activation=False))
        return groups

    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> MixerContext:
        x = self.heads_of(parts["x"])
        b, length = x.shape[:2]
        gn = (self.ngroups, self.d_state)
        if self.data_dependent:
            dt_f, dt_b = parts["dt"].chunk(2, dim=-1)
            delta_f, delta_b = self.ssm.delta(dt_f), self.ssm.delta(dt_b)
            if self.shared_bc:
                B_f = B_b = parts["B"].unflatten(-1, gn)
                C_f = C_b = parts["C"].unflatten(-1, gn)
            else:
                B_f, C_f, B_b, C_b = (parts[n].unflatten(-1, gn) for n in ("B_f", "C_f", "B_b", "C_b"))
        else:
            bc = self.BC[:length].to(x.dtype)[None].expand(b, -1, -1)
            B_f, C_f = (t.unflatten(-1, gn) for t in bc.chunk(2, dim=-1))
            B_b, C_b = B_f, C_f
            constant = self.ssm.delta(x.new_zeros(b, length, self.config.num_heads))
            delta_f = delta_b = constant
        diag = None
        if self.use_diag:
            diag = self.fc_D(parts["x"]) + self.ssm.D.to(x.dtype)
        values = torch.cat([x, x], dim=2) if self.combine == "concat" else x
        return MixerContext(values=values, mask=mask, x=x, delta_f=delta_f, delta_b=delta_b,
                            B_f=B_f, C_f=C_f, B_b=B_b, C_b=C_b, diag=diag, A=self.ssm.A(x.dtype))

    def heads_of(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.config.num_heads, -1))

    # -- the matrix and the fast path ---------------------------------------------------------------
    def matrix(self, ctx: MixerContext) -> Tensor:
        if self.combine == "product":
            raise NotMaterializableError(
                f"{type(self).__name__} multiplies the two scan directions elementwise: it is not linear in its "
                "values, so it has no L x L matrix (each direction alone has one)"
            )
        fwd = (ctx.delta_f, ctx.A, ctx.B_f, ctx.C_f)
        bwd = (ctx.delta_b, ctx.A, ctx.B_b, ctx.C_b)
        if self.combine == "concat":
            lower = scan_matrix(*fwd, shift=self.shift)
            upper = scan_matrix(None, None, None, None, *bwd, shift=self.shift)
            return torch.cat([lower, upper], dim=1).to(ctx.x.dtype)
        return scan_matrix(*fwd, *bwd, ctx.diag, shift=self.shift).to(ctx.x.dtype)

    def mix(self, ctx: MixerContext) -> Tensor:
        x = ctx.x
        if self.combine == "sum":
            return quasiseparable(
                x, ctx.delta_f, ctx.A, ctx.B_f, ctx.C_f, dt_bwd=ctx.delta_b, B_bwd=ctx.B_b, C_bwd=ctx.C_b,
                diag=ctx.diag, shift=self.shift, chunk_size=self.chunk_size,
            )
        y_f = directional_scan(x, ctx.delta_f, ctx.A, ctx.B_f, ctx.C_f, shift=self.shift, chunk_size=self.chunk_size)
        y_b = directional_scan(x, ctx.delta_b, ctx.A, ctx.B_b, ctx.C_b, reverse=True, shift=self.shift,
                               chunk_size=self.chunk_size)
        if self.combine == "product":
            return y_f * y_b
        return torch.cat([y_f, y_b], dim=2)

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        h, p = self.config.num_heads, self.headdim
        scan = chunked_scan_flops(batch, length, h, p, self.ngroups, self.d_state, 2, self.chunk_size)
        if self.combine != "sum":  # two single-direction scans, each with its own intra-chunk product
            scan = 2 * chunked_scan_flops(batch, length, h, p, self.ngroups, self.d_state, 1, self.chunk_size)
        parts = {"scan": scan}
        if self.use_diag:
            parts["diag_proj"] = 2 * batch * length * self.d_inner * h
        return parts


class QuasiseparableMixer(BidirectionalSSMBlock):
    """Hydra: shifted forward and backward scans plus a free data-dependent diagonal."""

    shift = True
    use_diag = True
    combine = "sum"


SPEC = MixerSpec(
    name="quasiseparable",
    aliases=("quasi", "hydra"),
    config=QuasiseparableConfig,
    builder=QuasiseparableMixer,
    summary="Hydra: quasiseparable matrix mixer (bidirectional SSD + shift + data-dependent diagonal)",
    matrix_class="quasiseparable",
    direction="bidirectional",
    complexity="O(L)",
    data_dependent="option",
    test_options={"headdim": 16, "d_state": 8, "chunk_size": 8},
)
