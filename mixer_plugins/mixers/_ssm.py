"""What the SSM-generated mixers share: their options, the per-head SSM parameters, and the bidirectional SSM mixer.

``semiseparable`` (causal SSD) builds on the options and parameters here. :class:`QuasiseparableMixer` (Hydra, its
module :mod:`.quasiseparable` holds its options and spec) lives here because the bidirectional ablations
(:mod:`.bidirectional_ablations`) are the same class built with other ``shift``/``diag``/``combine`` arguments.

Names: ``dt`` are the step sizes (``clamp(softplus(raw + dt_bias), *dt_limit)``); ``D``/``A_log``/``dt_bias`` keep
Mamba's parameter names. The scan ops receive the raw step-size projections with ``dt_bias`` and ``dt_limit``
(:class:`StepOptions`) and form the step sizes themselves, in float32 (inside the kernels on the GPU), as mamba-ssm
does, and likewise ``A = -exp(A_log)`` from ``A_log``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, Literal, Optional, TypedDict

import torch
from pydantic import AllowInfNan, Field, model_validator
from torch import Tensor, nn

from ..errors import NotMaterializableError
from ..kernels import chunked_scan_flops, directional_scan, quasiseparable, scan_matrix
from ..kernels.scan.inputs import prepare_dt
from .block import BlockConfig, BlockContext, ChannelGroup, DataIndependentOptions, MatrixMixerBlock

__all__ = ["BidirectionalConfig", "QuasiseparableMixer", "SSMBlockConfig", "SSMParameters", "ScanContext",
           "StepOptions", "compute_dtype", "init_dt_bias", "step_sizes"]


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
    dt_limit: tuple[float, Annotated[float, AllowInfNan(True)]] = Field(
        (0.0, math.inf), description="step sizes are clamped to [lo, hi] after the softplus (mamba-ssm/Hydra's "
        "dt_limit; default: no clamp; hi may be inf, the one float option that may)"
    )
    conv_init: Optional[float] = Field(
        None, gt=0, description="initialise the short-conv weights U[-conv_init, conv_init] (mamba-ssm/Hydra's "
        "conv_init; default None: PyTorch's Conv1d init)"
    )
    norm_per_group: bool = Field(
        False, description="gated RMSNorm statistics per group of d_inner / ngroups channels, as Mamba-2 does "
        "when ngroups > 1 (default: over the whole inner width, as Hydra does)"
    )

    @model_validator(mode="after")
    def _check_ssm(self) -> SSMBlockConfig:
        if self.num_heads % self.ngroups:
            raise ValueError(f"heads ({self.num_heads} = expand*dim/head_dim) must be a multiple of ngroups "
                             f"({self.ngroups})")
        if not self.dt_min <= self.dt_max:
            raise ValueError(f"dt_min ({self.dt_min}) must not exceed dt_max ({self.dt_max})")
        lo, hi = self.A_init_range
        if not 0 < lo <= hi:
            raise ValueError(f"A_init_range must satisfy 0 < lo <= hi, got {self.A_init_range}")
        lo, hi = self.dt_limit
        if not 0 <= lo <= hi:
            raise ValueError(f"dt_limit must satisfy 0 <= lo <= hi, got {self.dt_limit}")
        return self


def init_dt_bias(heads: int, dt_min: float, dt_max: float, floor: float) -> Tensor:
    """Inverse softplus of step sizes drawn log-uniformly in [dt_min, dt_max] (Mamba-2's initialisation)."""
    dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


class SSMParameters(nn.Module):
    """A (through ``A_log``), ``dt_bias`` and, optionally, the diagonal skip ``D`` (``d_width`` entries: one per
    head, or one per channel), per head."""

    def __init__(self, heads: int, config: SSMBlockConfig, *, d_width: int | None):
        super().__init__()
        self.A_init_range = tuple(config.A_init_range)
        self.dt_init = (config.dt_min, config.dt_max, config.dt_init_floor)
        lo, hi = config.dt_limit
        self.dt_limit = (float(lo), float(hi))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(d_width)) if d_width else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``A = -U[lo, hi]``, step sizes log-uniform in [dt_min, dt_max] (through ``dt_bias``), ``D = 1``."""
        lo, hi = self.A_init_range
        self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(lo, hi)))
        self.dt_bias.copy_(init_dt_bias(self.dt_bias.shape[0], *self.dt_init))
        if self.D is not None:
            self.D.fill_(1.0)

    def A(self, dtype: torch.dtype) -> Tensor:
        """The per-head decay rates ``A = -exp(A_log)`` (negative), in float32 for half-precision ``dtype`` (as
        mamba-ssm keeps them: a bfloat16 ``A`` would be off by up to 0.4%, and every decay with it)."""
        return -torch.exp(self.A_log.to(compute_dtype(dtype)))

    def dt(self, raw: Tensor) -> Tensor:
        """Step sizes ``clamp(softplus(raw + dt_bias), *dt_limit)`` from the raw per-token, per-head projections, in
        float32 when ``raw`` is half precision (under autocast the projections are bfloat16; the step sizes and
        every decay formed from them stay float32, as in mamba-ssm and the released Hydra). The scan ops form them
        the same way from :meth:`step_options`."""
        return prepare_dt(raw, self.dt_bias, True, self.dt_limit)

    def step_options(self) -> StepOptions:
        """What the scan ops take to form the step sizes from raw projections themselves (``dt_bias``,
        ``dt_softplus``, ``dt_limit``)."""
        return StepOptions(dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit)


class StepOptions(TypedDict):
    """Keyword arguments of the scan ops that turn raw step-size projections into step sizes."""

    dt_bias: Tensor
    dt_softplus: bool
    dt_limit: tuple[float, float]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype step sizes and decays are formed in for inputs of ``dtype``: float32 for half precision, else
    ``dtype`` itself (float32 or float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def step_sizes(dt: Tensor, steps: StepOptions | None) -> Tensor:
    """The step sizes from ``dt`` as a context holds it: through :func:`~mixer_plugins.kernels.scan.inputs.prepare_dt`
    with ``steps``, as the scan op forms them, or ``dt`` itself when ``steps`` is None."""
    if steps is None:
        return dt
    return prepare_dt(dt, steps["dt_bias"], steps["dt_softplus"], steps["dt_limit"])


class BidirectionalConfig(SSMBlockConfig):
    """Options of the bidirectional SSM mixers (Hydra's block, two scan directions)."""


@dataclasses.dataclass(eq=False, kw_only=True)
class ScanContext(BlockContext):
    """Generators of a two-direction scan: per direction ``dt_f``/``dt_b`` (b, L, h) as the scan op takes them and
    ``B``/``C`` (b, L, groups, N); one ``A_log`` (h,) (:attr:`A` the rates ``-exp(A_log)``); the optional diagonal
    ``diag`` (b, L, h); ``x`` the value heads. ``steps``: how the op turns ``dt_f``/``dt_b`` into step sizes (the raw
    projections with ``dt_bias``, softplus and ``dt_limit``), or None when they are the step sizes already;
    :meth:`step_sizes` gives the step sizes."""

    x: Tensor
    A_log: Tensor
    dt_f: Tensor
    dt_b: Tensor
    steps: StepOptions | None
    B_f: Tensor
    C_f: Tensor
    B_b: Tensor
    C_b: Tensor
    diag: Tensor | None = None

    @property
    def A(self) -> Tensor:
        """The decay rates ``-exp(A_log)`` (float32 for half-precision ``x``), as the scan op forms them."""
        return -torch.exp(self.A_log.to(compute_dtype(self.x.dtype)))

    def step_sizes(self) -> tuple[Tensor, Tensor]:
        """Both directions' step sizes (float32 or wider), as the scan op forms them."""
        return step_sizes(self.dt_f, self.steps), step_sizes(self.dt_b, self.steps)

    def with_step_sizes(self) -> ScanContext:
        """This context with the step sizes formed once (for callers that read them besides the scan)."""
        dt_f, dt_b = self.step_sizes()
        return dataclasses.replace(self, dt_f=dt_f, dt_b=dt_b, steps=None)


def bidirectional_groups(config: SSMBlockConfig) -> list[ChannelGroup]:
    """The channel groups of Hydra's in_proj after ``z``: x, the B/C generators, then the raw step sizes."""
    gn = config.ngroups * config.d_state
    groups = [ChannelGroup("x", config.d_inner)]
    if not getattr(config, "data_dependent", True):
        return groups
    if getattr(config, "shared_bc", False):
        groups += [ChannelGroup("B", gn), ChannelGroup("C", gn)]
    else:
        groups += [ChannelGroup(n, gn) for n in ("B_f", "C_f", "B_b", "C_b")]
    groups.append(ChannelGroup("dt", 2 * config.num_heads, conv=False, activation=False))
    return groups


class QuasiseparableMixer(MatrixMixerBlock[ScanContext]):
    """Hydra: shifted forward and backward scans plus a free data-dependent diagonal.

    ``shift``, ``diag`` and ``combine`` give the ablations of the paper (:mod:`.bidirectional_ablations`): Hydra is
    ``shift=True, diag=True, combine="sum"``. ``config`` may be a plain :class:`BidirectionalConfig` (the options
    of Hydra's own, ``shared_bc``, ``learnable_init_states`` and the data-independent form, then take their defaults).
    """

    def __init__(self, config: BidirectionalConfig, *, shift: bool = True, diag: bool = True,
                 combine: Literal["sum", "product", "concat"] = "sum"):
        super().__init__(config, bidirectional_groups(config),
                         out_width=2 * config.d_inner if combine == "concat" else None)
        self.shift, self.use_diag, self.combine = shift, diag, combine
        self.shared_bc = bool(getattr(config, "shared_bc", False))
        self.data_dependent = bool(getattr(config, "data_dependent", True))
        self.d_state = config.d_state
        self.ngroups = config.ngroups
        self.chunk_size = config.chunk_size
        self.scan_heads = config.num_heads
        if combine == "concat":
            self.num_heads = 2 * config.num_heads  # the matrix has a forward and a backward block of heads
        self.materializable = combine != "product"
        self.ssm = SSMParameters(self.scan_heads, config, d_width=self.scan_heads if diag else None)
        self.fc_D = nn.Linear(self.d_inner, self.scan_heads, bias=False) if diag else None
        self.max_seq_len = None
        self.BC: nn.Parameter | None = None
        if not self.data_dependent:
            assert isinstance(config, DataIndependentOptions), "data_dependent is an option of the free form's mixers"
            self.max_seq_len = config.free_length
            self.BC = nn.Parameter(torch.empty(config.free_length, 2 * self.ngroups * self.d_state))
            nn.init.xavier_normal_(self.BC)
        self.init_states: nn.Parameter | None = None
        if getattr(config, "learnable_init_states", False):
            self.init_states = nn.Parameter(torch.zeros(self.scan_heads, self.head_dim, self.d_state))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.BC is not None:
            nn.init.xavier_normal_(self.BC)
        if self.init_states is not None:
            self.init_states.zero_()

    # -- the generators -------------------------------------------------------------------------------
    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> ScanContext:
        x = parts["x"].unflatten(-1, (self.scan_heads, -1))
        b, length = x.shape[:2]
        gn = (self.ngroups, self.d_state)
        if self.BC is None:  # the data-dependent form
            # both directions' raw step sizes: (b, L, 2, h) -> two strided views (the scan op prepares them)
            dt_f, dt_b = parts["dt"].unflatten(-1, (2, self.scan_heads)).unbind(dim=2)
            if self.shared_bc:
                B_f = B_b = parts["B"].unflatten(-1, gn)
                C_f = C_b = parts["C"].unflatten(-1, gn)
            else:
                B_f, C_f, B_b, C_b = (parts[n].unflatten(-1, gn) for n in ("B_f", "C_f", "B_b", "C_b"))
        else:
            bc = self.BC[:length].to(x.dtype)[None].expand(b, -1, -1)
            B_f, C_f = (t.unflatten(-1, gn) for t in bc.chunk(2, dim=-1))
            B_b, C_b = B_f, C_f
            dt_f = dt_b = x.new_zeros(b, length, self.scan_heads)  # time-invariant steps: softplus(dt_bias)
        diag = None
        if self.fc_D is not None and self.ssm.D is not None:  # use_diag
            # diag = W_D x + D as one fused multiply-add (D is the bias of the product; the tokens flattened into the
            # rows of a view, as F.linear would only for a contiguous x, which a slice of the conv's output is not)
            rows = parts["x"].flatten(0, 1)
            diag = torch.addmm(self.ssm.D.to(x.dtype), rows, self.fc_D.weight.t()).unflatten(0, (b, length))
        values = torch.cat([x, x], dim=2) if self.combine == "concat" else x
        return ScanContext(values=values, mask=mask, x=x, A_log=self.ssm.A_log, dt_f=dt_f, dt_b=dt_b,
                           steps=self.ssm.step_options(), B_f=B_f, C_f=C_f, B_b=B_b, C_b=C_b, diag=diag)

    # -- the matrix and the fast path ---------------------------------------------------------------
    def matrix(self, ctx: ScanContext) -> Tensor:
        if self.combine == "product":
            raise NotMaterializableError(
                f"{type(self).__name__} multiplies the two scan directions elementwise: it is not linear in its "
                "values, so it has no L x L matrix (each direction alone has one)"
            )
        dt_f, dt_b = ctx.step_sizes()
        fwd = (dt_f, ctx.A, ctx.B_f, ctx.C_f)
        bwd = (dt_b, ctx.A, ctx.B_b, ctx.C_b)
        if self.combine == "concat":
            lower = scan_matrix(*fwd, shift=self.shift)
            upper = scan_matrix(None, None, None, None, *bwd, shift=self.shift)
            return torch.cat([lower, upper], dim=1).to(ctx.x.dtype)
        return scan_matrix(*fwd, *bwd, ctx.diag, shift=self.shift).to(ctx.x.dtype)

    def mix(self, ctx: ScanContext) -> Tensor:
        x = ctx.x
        steps: dict[str, Any] = dict(ctx.steps or {})
        if self.combine == "sum":
            return quasiseparable(
                x, ctx.dt_f, None, ctx.B_f, ctx.C_f, A_log=ctx.A_log, dt_bwd=ctx.dt_b, B_bwd=ctx.B_b, C_bwd=ctx.C_b,
                diag=ctx.diag, shift=self.shift, chunk_size=self.chunk_size, **steps,
            )
        y_f = directional_scan(x, ctx.dt_f, None, ctx.B_f, ctx.C_f, A_log=ctx.A_log, shift=self.shift,
                               chunk_size=self.chunk_size, **steps)
        y_b = directional_scan(x, ctx.dt_b, None, ctx.B_b, ctx.C_b, A_log=ctx.A_log, reverse=True, shift=self.shift,
                               chunk_size=self.chunk_size, **steps)
        if self.combine == "product":
            return y_f * y_b
        return torch.cat([y_f, y_b], dim=2)

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        h, p = self.scan_heads, self.head_dim
        scan = chunked_scan_flops(batch, length, h, p, self.ngroups, self.d_state, 2, self.chunk_size)
        if self.combine != "sum":  # two single-direction scans, each with its own intra-chunk product
            scan = 2 * chunked_scan_flops(batch, length, h, p, self.ngroups, self.d_state, 1, self.chunk_size)
        parts = {"scan": scan}
        if self.use_diag:
            parts["diag_proj"] = 2 * batch * length * self.d_inner * h
        return parts

    def initial_state_term(self, ctx: ScanContext) -> Tensor:
        """What the initial state ``S0`` adds to the mixed values, (batch, length, heads, head_dim).

        Each direction's scan starts from ``S0`` (Hydra repeats it for both), so after the shift position ``i`` gets
        ``exp(A sum_{k<=i-1} dt^f_k) C_{f,i-1} . S0`` from the forward scan (``i >= 1``) and
        ``exp(A sum_{k>=i+1} dt^b_k) C_{b,i+1} . S0`` from the backward one (``i <= L-2``); the backward sum runs over
        real tokens only (pads have zero step), so a padded row equals the unpadded one.
        """
        if self.init_states is None:
            raise RuntimeError(f"{type(self).__name__} was built without learnable_init_states: no initial state")
        s0 = self.init_states.to(ctx.x.dtype)                        # (h, p, n)
        rep = self.scan_heads // self.ngroups
        dt_f, dt_b = ctx.step_sizes()
        if ctx.mask is not None:
            keep = ctx.mask[..., None].to(dt_b.dtype)
            dt_f, dt_b = dt_f * keep, dt_b * keep
        A = ctx.A.to(dt_f.dtype)                                     # the decays in the step sizes' dtype
        decay_f = torch.exp(A * torch.cumsum(dt_f, dim=1))                         # sum_{k<=t}
        decay_b = torch.exp(A * torch.flip(torch.cumsum(torch.flip(dt_b, (1,)), dim=1), (1,)))  # sum_{k>=t}
        read_f = torch.einsum("blhn,hpn->blhp", ctx.C_f.repeat_interleave(rep, dim=2), s0) * decay_f[..., None]
        read_b = torch.einsum("blhn,hpn->blhp", ctx.C_b.repeat_interleave(rep, dim=2), s0) * decay_b[..., None]
        zero = torch.zeros_like(read_f[:, :1])
        return torch.cat([zero, read_f[:, :-1]], dim=1) + torch.cat([read_b[:, 1:], zero], dim=1)

    def finish(self, ctx: ScanContext, y: Tensor) -> Tensor:
        if self.init_states is not None:
            y = y + self.initial_state_term(ctx).to(y.dtype)
        return super().finish(ctx, y)
