"""``low_rank`` (alias ``linear_attention``): the low-rank matrix mixer, i.e. linear attention.

Matrix (per head): ``M_ij = <q_i, k_j>`` with SiLU-activated queries and keys, applied as
``y = s M v + v`` with ``s = 1/sqrt(L * qk_dim)`` (L = ``scale_length``, or ``max_seq_len`` for the
data-independent form). The fast path never builds M: bidirectionally ``y_i = s q_i (sum_j k_j v_j^T) + v_i``
in O(L); causally the same sum restricted to j <= i, computed by the chunked scan with no decay
(A = 0, dt = 1), also O(L).

Decoding (causal) keeps the running sum ``S = sum_j k_j v_j^T`` per head (head_dim x qk_dim) and the short
convolution's last inputs: constant memory and work per token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kernels import chunked_scan_flops, ssd
from ..kernels.scan.step import ssd_step
from ..registry.spec import MixerSpec
from .block import MatrixMixerBlock
from .cache import MixerCache
from .qk_block import BlockQKContext, QKBlockConfig, QKMixerBlock, queries_and_keys

__all__ = ["LowRankConfig", "LowRankMixer", "SPEC"]


class LowRankConfig(QKBlockConfig):
    """Options of the low-rank mixer (linear attention)."""


#: Chunk length of the causal form's scan.
_CHUNK = 64


class LowRankMixer(QKMixerBlock):
    """Linear attention ``M = q k^T`` with SiLU queries and keys, applied without building M."""

    qk_activation = True
    steppable = True

    def output_scale(self) -> float:
        return 1.0 / math.sqrt(self.norm_length * self.qk_dim)

    def qk_matrix(self, q: Tensor | None, k: Tensor | None, ctx: BlockQKContext) -> Tensor:
        q, k = queries_and_keys(q, k)
        return torch.einsum("bihd,bjhd->bhij", q, k)

    def mix(self, ctx: BlockQKContext) -> Tensor:
        v = ctx.values
        b, length, h, _ = v.shape
        q, k = queries_and_keys(ctx.q, ctx.k)
        q, k = q.expand(b, -1, -1, -1), k.expand(b, -1, -1, -1)
        s = self.output_scale()
        if not self.causal:
            state = torch.einsum("bjhd,bjhp->bhdp", k, v)
            return s * torch.einsum("bihd,bhdp->bihp", q, state) + v
        # Causal linear attention is SSD with no decay: A = 0, dt = 1, one group per head (B = k, C = q).
        ones = v.new_ones(b, length, h)
        zeros = v.new_zeros(h)
        y = ssd(v, ones, zeros, k.contiguous(), q.contiguous(), chunk_size=_CHUNK)
        return s * y + v

    # -- decoding (causal) ----------------------------------------------------------------------------
    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        # the block's convolution state, then a constant-size state instead of QKMixerBlock's keys and values
        MatrixMixerBlock.init_cache(self, cache, batch, max_len, dtype, device)
        cache.state["kv"] = torch.zeros(batch, self.num_heads, self.head_dim, self.qk_dim, dtype=dtype,
                                        device=device)

    def _scan_args(self, ctx: BlockQKContext,
                   dt: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        v = ctx.values
        b, length, h, _ = v.shape
        q, k = queries_and_keys(ctx.q, ctx.k)
        q, k = q.expand(b, -1, -1, -1), k.expand(b, -1, -1, -1)
        ones = v.new_ones(b, length, h) if dt is None else dt
        return v, ones, v.new_zeros(h), k.contiguous(), q.contiguous()

    def fill_cache(self, cache: MixerCache, ctx: BlockQKContext, x: Tensor, lengths: Tensor) -> Tensor:
        self.fill_conv_cache(cache, x, lengths)
        v = ctx.values
        # no update at pads (their step is 0), so each row's sum stops at its own last token
        dt = None if ctx.mask is None else ctx.mask[..., None].to(v.dtype).expand(-1, -1, v.shape[2])
        y, state = ssd(*self._scan_args(ctx, dt), chunk_size=_CHUNK, return_final_states=True)
        cache.state["kv"].copy_(state.detach())
        return self.output_scale() * y + v

    def step_tokens(self, x: Tensor, cache: MixerCache) -> Tensor:
        if x.shape[1] == 1 and self.data_dependent:   # one token: the fused step (q is the read-out, k the input)
            out = self.fused_ssd_step(x, cache, "kv", A_log=None, D=1.0, bc_order="CB", scale=self.output_scale())
            if out is not None:
                return out
        return super().step_tokens(x, cache)

    def mix_step(self, ctx: BlockQKContext, cache: MixerCache) -> Tensor:
        state = cache.state["kv"]
        # the sum runs in the wider of the state's and the inputs' dtypes (a float32 state accumulates a bf16 model)
        start = cache.read("kv", torch.promote_types(state.dtype, ctx.values.dtype))
        if ctx.values.shape[1] == 1:
            y, new = ssd_step(*self._scan_args(ctx), start)
        else:
            y, new = ssd(*self._scan_args(ctx), chunk_size=_CHUNK, initial_states=start, return_final_states=True)
        state.copy_(new.detach())
        return self.output_scale() * y + ctx.values

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        h, p, d = self.num_heads, self.head_dim, self.qk_dim
        if not self.causal:
            return {"kv_state": 2 * batch * length * h * d * p, "readout": 2 * batch * length * h * d * p}
        return {"scan": chunked_scan_flops(batch, length, h, p, h, d, 1, _CHUNK)}


SPEC = MixerSpec(
    name="low_rank",
    aliases=("linear_attention",),
    config=LowRankConfig,
    builder=LowRankMixer,
    summary="low-rank matrix mixer = linear attention (SiLU q, k), in the Hydra block",
    matrix_class="low-rank",
    direction="either",
    complexity="O(L)",
    data_dependent="option",
    stepping=True,
    test_options={"head_dim": 16, "qk_dim": 4},
)
