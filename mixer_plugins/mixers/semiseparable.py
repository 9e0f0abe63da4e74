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
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor

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
        super().__init__(config, groups, causal_conv=True)
        self.d_state = config.d_state
        self.ngroups = config.ngroups
        self.chunk_size = config.chunk_size
        self.ssm = SSMParameters(self.num_heads, config, with_d=True)

    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> SSDContext:
        x = self.heads(parts["x"])
        gn = (self.ngroups, self.d_state)
        return SSDContext(
            values=x, mask=mask, dt=parts["dt"], steps=self.ssm.step_options(), A=self.ssm.A(x.dtype),
            B=parts["B"].unflatten(-1, gn), C=parts["C"].unflatten(-1, gn),
        )

    def matrix(self, ctx: SSDContext) -> Tensor:
        assert self.ssm.D is not None, "built with_d=True"
        dt = ctx.step_sizes()
        diag = self.ssm.D.to(ctx.values.dtype).expand_as(dt)
        return scan_matrix(dt, ctx.A, ctx.B, ctx.C, diag=diag).to(ctx.values.dtype)

    def mix(self, ctx: SSDContext) -> Tensor:
        return ssd(ctx.values, ctx.dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self.ssm.D,
                   **(ctx.steps or {}))

    # -- decoding ------------------------------------------------------------------------------------
    def init_mixer_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                         device: torch.device) -> None:
        cache.state["ssm"] = torch.zeros(batch, self.num_heads, self.head_dim, self.d_state, dtype=dtype,
                                         device=device)

    def mix_prefill(self, ctx: SSDContext, cache: MixerCache, lengths: Tensor) -> Tensor:
        dt = ctx.step_sizes()
        dt = dt if ctx.mask is None else torch.where(ctx.mask[..., None], dt, dt.new_zeros(()))
        y, state = ssd(ctx.values, dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self.ssm.D,
                       return_final_states=True)
        cache.state["ssm"].copy_(state.detach())
        return y

    def step_tokens(self, x: Tensor, cache: MixerCache) -> Tensor:
        if x.shape[1] == 1:   # one token: the fused step
            out = self.fused_ssd_step(x, cache, "ssm", A_log=self.ssm.A_log, D=self.ssm.D,
                                      steps=self.ssm.step_options())
            if out is not None:
                return out
        return super().step_tokens(x, cache)

    def mix_step(self, ctx: SSDContext, cache: MixerCache) -> Tensor:
        state = cache.state["ssm"]
        # the scan runs in the wider of the state's and the inputs' dtypes (a float32 state accumulates a bf16 model)
        start = cache.read("ssm", torch.promote_types(state.dtype, ctx.values.dtype))
        if ctx.values.shape[1] == 1:
            y, new = ssd_step(ctx.values, ctx.step_sizes(), ctx.A, ctx.B, ctx.C, start, D=self.ssm.D)
        else:
            y, new = ssd(ctx.values, ctx.dt, ctx.A, ctx.B, ctx.C, chunk_size=self.chunk_size, D=self.ssm.D,
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
