"""An example third-party mixer: a causal exponential moving average per head.

Matrix: ``M_ij = (1 - a_h) * a_h ** (i - j)`` for ``j <= i`` (0 above the diagonal), with a learned
decay ``a_h = sigmoid(w_h)`` per head, applied to projected values and followed by an output projection.
It is a Toeplitz, 1-semiseparable matrix with no length-sized parameters, so it runs at any length.

It also decodes token by token (``stepping=True``): its output *is* the running average
``s_i = a s_{i-1} + (1 - a) v_i``, so the cache holds one state per head and channel.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from mixer_plugins import MatrixMixer, MixerConfig, MixerContext, MixerSpec
from mixer_plugins.mixers.cache import MixerCache


class EMAConfig(MixerConfig):
    num_heads: int = Field(4, gt=0, description="number of heads, each with its own decay")

    @model_validator(mode="after")
    def _divisible(self) -> EMAConfig:
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) is not divisible by num_heads ({self.num_heads})")
        return self


class EMAMixer(MatrixMixer):
    causal = True
    steppable = True

    def __init__(self, config: EMAConfig):
        super().__init__(config)
        self.num_heads = config.num_heads
        self.value = nn.Linear(config.dim, config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.decay_logit = nn.Parameter(self._initial_decay_logit())

    def _initial_decay_logit(self) -> Tensor:
        """Decays from fast to slow across the heads: ``sigmoid`` of -1 ... 3."""
        return torch.linspace(-1.0, 3.0, self.num_heads)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw the projections and set the decays again: a parameter of the mixer's own is not a child module's,
        so ``MatrixMixer.reset_parameters`` alone would leave it as it is (uninitialised memory after
        ``to_empty``)."""
        super().reset_parameters()
        self.decay_logit.copy_(self._initial_decay_logit())

    def prepare(self, x: Tensor, mask: Tensor | None) -> MixerContext:
        values = self.value(x).unflatten(-1, (self.num_heads, -1))
        return MixerContext(values=values, mask=mask)

    def matrix(self, ctx: MixerContext) -> Tensor:
        length = ctx.values.shape[1]
        pos = torch.arange(length, device=ctx.values.device)
        lag = (pos[:, None] - pos[None, :]).to(ctx.values.dtype)       # i - j
        log_a = nn.functional.logsigmoid(self.decay_logit)[:, None, None]  # (heads, 1, 1)
        weights = (1 - log_a.exp()) * torch.exp(lag.clamp(min=0) * log_a)
        weights = weights.masked_fill(lag < 0, 0.0)                     # causal
        return weights.expand(ctx.values.shape[0], -1, -1, -1)

    # -- decoding: the state is the last output (before the projection) -------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        cache.state["ema"] = torch.zeros(batch, self.num_heads, self.dim // self.num_heads, dtype=dtype,
                                         device=device)

    def fill_cache(self, cache: MixerCache, ctx: MixerContext, x: Tensor, lengths: Tensor) -> Tensor:
        y = self.mix(ctx)
        last = (lengths - 1).clamp(min=0)[:, None, None, None].expand(-1, 1, *y.shape[2:])
        state = y.gather(1, last)[:, 0]
        cache.state["ema"].copy_(torch.where((lengths > 0)[:, None, None], state, 0.0).detach())
        return y

    def mix_step(self, ctx: MixerContext, cache: MixerCache) -> Tensor:
        a = torch.sigmoid(self.decay_logit).to(ctx.values.dtype)[:, None]     # (heads, 1)
        state = cache.state["ema"]
        outputs = []
        for i in range(ctx.values.shape[1]):
            state = a * state + (1 - a) * ctx.values[:, i]
            outputs.append(state)
        cache.state["ema"].copy_(state.detach())
        return torch.stack(outputs, dim=1)

    def finish(self, ctx: MixerContext, y: Tensor) -> Tensor:
        return self.proj(y.flatten(2))

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        return {
            "value_proj": 2 * batch * length * self.dim * self.dim,
            "mix": 2 * batch * length * length * self.dim,
            "out_proj": 2 * batch * length * self.dim * self.dim,
        }


SPEC = MixerSpec(
    name="ema",
    config=EMAConfig,
    builder=EMAMixer,
    summary="causal exponential moving average per head (example plugin)",
    aliases=("moving_average",),
    matrix_class="Toeplitz, 1-semiseparable",
    direction="causal",
    complexity="O(L^2) (materialized)",
    data_dependent="no",
    stepping=True,
)
