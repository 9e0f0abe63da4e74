"""``toeplitz``: the Toeplitz matrix mixer (a long convolution), applied by FFT in O(L log L).

Per head ``M_ij = c_{i-j}``, applied as ``y = s M v + v`` with ``s = 0.5/sqrt(L)``.

* Data-dependent: token t generates the taps of offset +t and -t, ``c_t = fw_t`` and ``c_{-t} = rv_t``
  (per-head scalars from in_proj, the short conv and SiLU), as the paper describes. The released code's
  taps are this kernel rotated cyclically by one offset and only run at L = max_seq_len; here the taps
  follow the paper and the mixer runs at any length (``L = scale_length`` in the scale).
* Data-independent: free taps ``c`` of shape (heads, 2 max_seq_len - 1); shorter sequences use the central
  2L - 1 of them.

``causal=True`` keeps the non-negative offsets only, and the product is arranged so that no output sees a later
token, not even through FFT round-off (direct tiles plus FFTs whose inputs precede their outputs; O(L log^2 L)).

Decoding (causal) keeps every token's values and (data-dependent form) its tap ``c_t``, since output ``i`` needs
``c_0 .. c_i`` and ``v_0 .. v_i``: a step is one dot product over the kept history per head and channel.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from ..kernels import toeplitz_causal_flops, toeplitz_fft_flops, toeplitz_matrix, toeplitz_mix
from ..registry.spec import MixerSpec
from .block import BlockContext, ChannelGroup
from .cache import MixerCache, kv_write
from .qk_block import SequenceBlockConfig, SequenceMixerBlock

__all__ = ["ToeplitzConfig", "ToeplitzMixer", "SPEC"]


class ToeplitzConfig(SequenceBlockConfig):
    """Options of the Toeplitz mixer."""


@dataclasses.dataclass(eq=False, kw_only=True)
class ToeplitzContext(BlockContext):
    """``taps`` (b|1, heads, 2L - 1): offsets -(L-1) .. L-1 of each head's kernel."""

    taps: Tensor


def _toeplitz_groups(config: ToeplitzConfig) -> list[ChannelGroup]:
    """The values, then (data-dependent form) per-head taps of the non-negative and (bidirectional) negative offsets."""
    groups = [ChannelGroup("v", config.d_inner)]
    if config.data_dependent:
        groups.append(ChannelGroup("fw", config.num_heads))
        if not config.causal:
            groups.append(ChannelGroup("rv", config.num_heads))
    return groups


class ToeplitzMixer(SequenceMixerBlock[ToeplitzContext]):
    """Toeplitz (long-convolution) mixer by FFT, with data-dependent or free taps."""

    steppable = True

    def __init__(self, config: ToeplitzConfig):
        super().__init__(config, _toeplitz_groups(config))
        self.scale = 0.5 / math.sqrt(self.norm_length)
        self.taps: nn.Parameter | None = None
        if not config.data_dependent:
            self.taps = self.free_parameter("taps", (self.num_heads, 2 * config.free_length - 1),
                                            nn.init.xavier_uniform_)

    def _free_taps(self) -> tuple[nn.Parameter, int]:
        """The data-independent form's taps (heads, 2 max_seq_len - 1) and the index of offset 0 in them."""
        assert self.taps is not None and self.max_seq_len is not None, "the data-independent form"
        return self.taps, self.max_seq_len - 1

    def build_context(self, parts: dict[str, Tensor], mask: Tensor | None) -> ToeplitzContext:
        values = self.heads(parts["v"])
        length = values.shape[1]
        if self.data_dependent:
            fw = parts["fw"].transpose(1, 2)                                   # (b, h, L): taps 0 .. L-1
            if self.causal:
                negative = fw.new_zeros(fw.shape[0], fw.shape[1], length - 1)
            else:
                negative = parts["rv"].transpose(1, 2)[..., 1:].flip(-1)      # taps -(L-1) .. -1 from rv_{L-1..1}
            taps = torch.cat([negative, fw], dim=-1)
        else:
            free, centre = self._free_taps()
            taps = free[:, centre - (length - 1): centre + length][None].to(values.dtype)
            if self.causal:
                taps = torch.cat([torch.zeros_like(taps[..., : length - 1]), taps[..., length - 1:]], dim=-1)
        return ToeplitzContext(values=values, mask=mask, taps=taps)

    def matrix(self, ctx: ToeplitzContext) -> Tensor:
        b, length = ctx.values.shape[:2]
        matrix = toeplitz_matrix(ctx.taps, length).expand(b, -1, -1, -1)
        return self.identity_plus(matrix, self.scale)

    def mix(self, ctx: ToeplitzContext) -> Tensor:
        if ctx.values.shape[0] == 0:  # an empty batch: nothing to convolve (the FFT rejects empty inputs)
            return torch.zeros_like(ctx.values)
        return toeplitz_mix(self.scale * ctx.taps, ctx.values, causal=self.causal) + ctx.values

    # -- decoding (causal) ----------------------------------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        super().init_cache(cache, batch, max_len, dtype, device)
        if self.data_dependent:
            cache.state["taps"] = torch.zeros(batch, max_len, self.num_heads, dtype=dtype, device=device)

    def fill_cache(self, cache: MixerCache, ctx: ToeplitzContext, x: Tensor, lengths: Tensor) -> Tensor:
        if self.data_dependent:  # the non-negative offsets 0 .. L-1: token d's tap c_d
            length = ctx.values.shape[1]
            cache.state["taps"][:, :length] = ctx.taps[..., length - 1:].transpose(1, 2).detach()
        return super().fill_cache(cache, ctx, x, lengths)

    def prepare_step(self, x: Tensor, cache: MixerCache) -> ToeplitzContext:
        ctx = super().prepare_step(x, cache)
        if self.data_dependent:  # a step's token t brings tap c_t (its fw group), nothing else of the context
            ctx.taps = ctx.taps[..., ctx.values.shape[1] - 1:].transpose(1, 2)   # (b, t, heads)
        return ctx

    def mix_step(self, ctx: ToeplitzContext, cache: MixerCache) -> Tensor:
        v = ctx.values
        b, t = v.shape[:2]
        positions = cache.positions(t)
        kv_write(cache.state["v"], v.detach(), positions)
        if self.data_dependent:
            kv_write(cache.state["taps"], ctx.taps.detach(), positions)
            taps = cache.read("taps", v.dtype)                                      # (b, max_len, h): offset d
        else:
            free, centre = self._free_taps()
            taps = free[:, centre:centre + cache.max_len].T[None].to(v.dtype)  # (1, max_len, h)
        # y_i = v_i + s * sum_{d <= i} c_d v_{i-d}: gather the history backwards from each position
        offsets = torch.arange(cache.max_len, device=v.device)
        source = positions[:, :, None] - offsets                                    # (b, t, max_len): i - d
        seen = source >= 0
        index = source.clamp(min=0).flatten(1)[..., None, None].expand(-1, -1, self.num_heads, self.head_dim)
        history = cache.state["v"].gather(1, index).unflatten(1, (t, cache.max_len)).to(v.dtype)  # (b, t, d, h, p)
        weights = torch.where(seen[..., None], taps[:, None], taps.new_zeros(()))   # (b, t, d, h)
        return self.scale * torch.einsum("btdh,btdhp->bthp", weights, history) + v

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        tap_batch = batch if self.data_dependent else 1
        if self.causal:
            return {"causal_conv": toeplitz_causal_flops(batch, length, self.num_heads, self.head_dim, tap_batch)}
        return {"fft_conv": toeplitz_fft_flops(batch, length, self.num_heads, self.head_dim, tap_batch)}


SPEC = MixerSpec(
    name="toeplitz",
    aliases=("long_conv",),
    config=ToeplitzConfig,
    builder=ToeplitzMixer,
    summary="Toeplitz matrix mixer (long convolution by FFT), data-dependent taps or free taps",
    matrix_class="Toeplitz",
    direction="either",
    complexity="O(L log L)",
    data_dependent="option",
    stepping=True,
    test_options={"head_dim": 16},
)
