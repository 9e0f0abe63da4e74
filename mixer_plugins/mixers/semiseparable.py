"""``semiseparable`` (aliases ``ssd``, ``mamba2``): the causal Mamba-2 SSD mixer in the Hydra block.

Per head the matrix is lower-triangular and N-semiseparable:
``m_ij = C_i.B_j exp(A sum_{k=j+1..i} dt_k) dt_j`` for ``j <= i``, plus the skip ``D`` on the diagonal,
computed in O(L) by :func:`mixer_plugins.kernels.ssd` (chunked SSD). The short convolution is causal
(kernel 4 by default, as in Mamba-2) and A starts in [-16, -1] as in Mamba-2. The block normalizes before
gating like the rest of the framework; ``norm_before_gate=False`` gives Mamba-2's order.

Decoding keeps the SSD state (batch, heads, head_dim, d_state) and the short convolution's last inputs: constant
memory and work per token. The prefill is the chunked scan with ``return_final_states`` (step sizes zeroed at pads,
so each row's state stops at its own last token); a one-token step is the recurrence
(:func:`~mixer_plugins.kernels.scan.step.ssd_step`), a longer one the chunked scan from the state.

The options of mamba-ssm's ``Mamba2`` that shape its function are options here too (``d_ssm``: an SSM narrower than
``expand * dim`` with a gated MLP beside it; ``D_has_hdim``: a skip per channel; ``rmsnorm=False``: the gate without
the norm), so :class:`mixer_plugins.compat.Mamba2` is this mixer with the released arguments and key names.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ..errors import NotMaterializableError
from ..kernels import chunked_scan_flops, scan_matrix, ssd
from ..kernels.scan.step import ssd_step
from ..registry.spec import MixerSpec
from ._ssm import SSMBlockConfig, SSMParameters, StepOptions, step_sizes
from .block import BlockContext, ChannelGroup, MatrixMixerBlock
from .cache import MixerCache

__all__ = ["SemiseparableConfig", "SemiseparableMixer", "SSDContext", "SPEC"]


class SemiseparableConfig(SSMBlockConfig):
    """Options of the causal SSD mixer (Mamba-2's defaults for the short conv and A)."""

    always_causal: ClassVar[bool] = True

    d_conv: int = Field(4, gt=0, description="kernel size of the causal short convolution")
    A_init_range: tuple[float, float] = Field((1.0, 16.0), description="A = -U[lo, hi] per head at init")
    d_ssm: Optional[int] = Field(
        None, gt=0, description="width of the SSM (default expand * dim); the remaining expand * dim - d_ssm channels "
        "are a gated MLP beside it, silu(z0) * x0 (Mamba-2's d_ssm)"
    )
    D_has_hdim: bool = Field(False, description="a skip D per channel instead of per head (no L x L matrix then)")
    rmsnorm: bool = Field(True, description="the gated RMSNorm before out_proj (False: the gate y * silu(z) alone)")

    @property
    def d_inner(self) -> int:
        """The SSM's width: ``d_ssm``, or ``expand * dim``."""
        return self.expand * self.dim if self.d_ssm is None else self.d_ssm

    @property
    def mlp_width(self) -> int:
        """The width of the gated MLP beside the SSM (``expand * dim - d_ssm``)."""
        return self.expand * self.dim - self.d_inner

    @model_validator(mode="after")
    def _check_d_ssm(self) -> SemiseparableConfig:
        if self.mlp_width < 0:
            raise ValueError(f"d_ssm ({self.d_ssm}) must not exceed expand * dim = {self.expand * self.dim}")
        return self


@dataclasses.dataclass(eq=False, kw_only=True)
class SSDContext(BlockContext):
    """Generators of the causal scan: ``dt`` (b, L, h) as the scan op takes it, ``A`` (h,), ``B``/``C`` (b, L, groups,
    N). ``steps``: how the op turns ``dt`` into step sizes (the raw projections with ``dt_bias``, softplus and
    ``dt_limit``), or None when it holds the step sizes already; :meth:`step_sizes` gives the step sizes."""

    dt: Tensor
    steps: StepOptions | None
    A: Tensor
    B: Tensor
    C: Tensor

    def step_sizes(self) -> Tensor:
        """The step sizes (float32 or wider), as the scan op forms them."""
        return step_sizes(self.dt, self.steps)

    def with_step_sizes(self) -> SSDContext:
        """This context with the step sizes formed once (for callers that read them besides the scan)."""
        return dataclasses.replace(self, dt=self.step_sizes(), steps=None)


class SemiseparableMixer(MatrixMixerBlock[SSDContext]):
    """Mamba-2's SSD in the Hydra block: causal short conv, chunked causal scan plus the ``D`` skip."""

    causal = True
    steppable = True

    def __init__(self, config: SemiseparableConfig):
        gn = config.ngroups * config.d_state
        groups = [
            ChannelGroup("x", config.d_inner),
            ChannelGroup("B", gn),
            ChannelGroup("C", gn),
            ChannelGroup("dt", config.num_heads, conv=False, activation=False),
        ]
        super().__init__(config, groups, causal_conv=True, mlp_width=config.mlp_width, norm=config.rmsnorm)
        self.d_state = config.d_state
        self.ngroups = config.ngroups
        self.chunk_size = config.chunk_size
        self.D_has_hdim = config.D_has_hdim
        self.materializable = not config.D_has_hdim
        self.ssm = SSMParameters(self.num_heads, config,
                                 d_width=config.d_inner if config.D_has_hdim else self.num_heads)

    def skip(self) -> Tensor:
        """The skip ``D``: (heads,), or (heads, head_dim) with ``D_has_hdim``."""
        D = self.ssm.D   # one module look-up: a decoding step calls this once a token
        assert D is not None, "the SSD mixer has a skip"
        return D.view(self.num_heads, self.head_dim) if self.D_has_hdim else D

    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> SSDContext:
        x = self.heads(parts["x"])
        gn = (self.ngroups, self.d_state)
        return SSDContext(
            values=x, mask=mask, dt=parts["dt"], steps=self.ssm.step_options(), A=self.ssm.A(x.dtype),
            B=parts["B"].unflatten(-1, gn), C=parts["C"].unflatten(-1, gn),
        )

    def matrix(self, ctx: SSDContext) -> Tensor:
        if self.D_has_hdim:
            raise NotMaterializableError(
                f"{type(self).__name__} with D_has_hdim=True adds a different skip D to each channel of a head: the "
                "heads' channels do not share one L x L matrix"
            )
        assert self.ssm.D is not None, "the SSD mixer has a skip"
        dt = ctx.step_sizes()
        diag = self.ssm.D.to(ctx.values.dtype).expand_as(dt)
        return scan_matrix(dt, ctx.A, ctx.B, ctx.C, diag=diag).to(ctx.values.dtype)

    def mix(self, ctx: SSDContext) -> Tensor:
        return ssd(ctx.values, ctx.dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self.skip(),
                   **(ctx.steps or {}))

    # -- decoding ------------------------------------------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        super().init_cache(cache, batch, max_len, dtype, device)
        cache.state["ssm"] = torch.zeros(batch, self.num_heads, self.head_dim, self.d_state, dtype=dtype,
                                         device=device)

    def fill_cache(self, cache: MixerCache, ctx: SSDContext, x: Tensor, lengths: Tensor) -> Tensor:
        self.fill_conv_cache(cache, x, lengths)
        dt = ctx.step_sizes()
        dt = dt if ctx.mask is None else torch.where(ctx.mask[..., None], dt, dt.new_zeros(()))
        y, state = ssd(ctx.values, dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self.skip(),
                       return_final_states=True)
        cache.state["ssm"].copy_(state.detach())
        return y

    def step_tokens(self, x: Tensor, cache: MixerCache) -> Tensor:
        if x.shape[1] == 1:   # one token: the fused step
            ssm = self.ssm
            out = self.fused_ssd_step(x, cache, "ssm", A_log=ssm.A_log, D=self.skip(), dt_bias=ssm.dt_bias,
                                      dt_softplus=True, dt_limit=ssm.dt_limit)
            if out is not None:
                return out
        return super().step_tokens(x, cache)

    def mix_step(self, ctx: SSDContext, cache: MixerCache) -> Tensor:
        state = cache.state["ssm"]
        # the scan runs in the wider of the state's and the inputs' dtypes (a float32 state accumulates a bf16 model)
        start = cache.read("ssm", torch.promote_types(state.dtype, ctx.values.dtype))
        if ctx.values.shape[1] == 1:
            y, new = ssd_step(ctx.values, ctx.step_sizes(), ctx.A, ctx.B, ctx.C, start, D=self.skip())
        else:
            y, new = ssd(ctx.values, ctx.dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self.skip(),
                         initial_states=start, return_final_states=True, **(ctx.steps or {}))
        state.copy_(new.detach())
        return y

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        return {"scan": chunked_scan_flops(batch, length, self.num_heads, self.head_dim, self.ngroups,
                                           self.d_state, 1, self.chunk_size)}


SPEC = MixerSpec(
    name="semiseparable",
    aliases=("ssd", "mamba2"),
    config=SemiseparableConfig,
    builder=SemiseparableMixer,
    summary="causal Mamba-2 SSD: semiseparable (lower-triangular) matrix mixer",
    matrix_class="semiseparable",
    direction="causal",
    complexity="O(L)",
    data_dependent="yes",
    stepping=True,
    test_options={"head_dim": 16, "d_state": 8, "chunk_size": 8},
)
