"""``vandermonde``: the (data-dependent) Vandermonde matrix mixer, the DFT, and the learned form.

Data-dependent (the paper's new SAM): per head,
``M_ij = sum_d [cos(2 pi eps q_{i,d} j) - cos(2 pi eps k_{j,d} i)]``, the real part of a Vandermonde matrix
with nodes ``exp(2 pi i eps q)`` minus the transpose of one with nodes ``exp(2 pi i eps k)``;
``y = s M v + v`` with ``s = 1/sqrt(2 L qk_dim)``. The time indices enter explicitly, so the mixer carries
position information by itself.

Data-independent:

* ``di_form="dft"`` (default): ``M_ij = cos(2 pi i j / max_seq_len)``, the real DFT (FNet), no parameters,
  ``s = 1/sqrt(max_seq_len)``;
* ``di_form="learned"``: the data-dependent formula with free (max_seq_len, heads, qk_dim) Q, K. The released
  code could not reach this form (and its einsum computed a diagonal); here it is a real Vandermonde mixer,
  initialised at N(0, 1) because Q = K = 0 would be a stationary point (cos'(0) = 0).

Decoding (causal) keeps every token's keys and values; a step computes its rows of M (positions explicit).
"""

from __future__ import annotations

import math
import operator
from functools import reduce
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from ..registry.spec import MixerSpec
from .qk_block import BlockQKContext, QKBlockConfig, QKMixerBlock

__all__ = ["VandermondeConfig", "VandermondeMixer", "SPEC"]


class VandermondeConfig(QKBlockConfig):
    """Options of the Vandermonde mixer."""

    frequency_scale: float = Field(1e-3, gt=0, description="eps in cos(2 pi eps q j): scales the learned frequencies")
    di_form: Literal["dft", "learned"] = Field(
        "dft", description="data-independent form: the fixed real DFT, or free learned Q, K"
    )


class VandermondeMixer(QKMixerBlock):
    """Vandermonde matrix mixer: data-dependent cosine nodes, the real DFT, or learned free nodes."""

    steppable = True

    def __init__(self, config: VandermondeConfig):
        # learned nodes start at N(0, 1): Q = K = 0 would be a stationary point (cos'(0) = 0)
        super().__init__(config, free_qk=config.di_form == "learned", free_qk_init=nn.init.normal_)
        self.frequency_scale = config.frequency_scale
        self.di_form = config.di_form

    def output_scale(self) -> float:
        if not self.data_dependent and self.di_form == "dft":
            return 1.0 / math.sqrt(self.norm_length)
        return 1.0 / math.sqrt(2 * self.norm_length * self.qk_dim)

    def qk_matrix(self, q: Tensor | None, k: Tensor | None, ctx: BlockQKContext) -> Tensor:
        t = torch.arange(ctx.values.shape[1], device=ctx.values.device, dtype=ctx.values.dtype)
        return self._rows(q, k, t[None], t)

    def qk_rows(self, q: Tensor | None, keys: Tensor | None, positions: Tensor, max_len: int) -> Tensor:
        dtype = self.in_proj.weight.dtype if q is None else q.dtype
        return self._rows(q, keys, positions.to(dtype), torch.arange(max_len, device=positions.device, dtype=dtype))

    def _rows(self, q: Tensor | None, k: Tensor | None, i: Tensor, j: Tensor) -> Tensor:
        """Rows at positions ``i`` (b|1, t) of M against columns ``j`` (J,): (b|1, heads, t, J). ``q`` (b|1, t, h, d)
        and ``k`` (b|1, J, h, d) are None for the DFT: one matrix shared by every head (norm_length is max_seq_len)."""
        if q is None or k is None:
            angle = 2 * math.pi * (i[:, :, None] * j) / self.norm_length
            return torch.cos(angle)[:, None].expand(-1, self.num_heads, -1, -1)
        omega_q = (2 * math.pi * self.frequency_scale) * q.permute(0, 2, 1, 3)          # (b, h, t, d)
        omega_k = (2 * math.pi * self.frequency_scale) * k.permute(0, 2, 1, 3)          # (b, h, J, d)
        # summed over d one slice at a time: O(t J) memory, not O(t J qk_dim)
        return reduce(operator.add, (torch.cos(omega_q[..., d, None] * j)
                                     - torch.cos(omega_k[:, :, None, :, d] * i[:, None, :, None])
                                     for d in range(self.qk_dim)))

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        h, p = self.num_heads, self.head_dim
        parts = {"apply": 2 * batch * h * length * length * p}
        if self.data_dependent or self.di_form == "learned":
            # two cosines, two products and two sums per (i, j, d): elementwise, not a matmul
            parts["matrix_elementwise"] = 6 * batch * h * length * length * self.qk_dim
        return parts


SPEC = MixerSpec(
    name="vandermonde",
    config=VandermondeConfig,
    builder=VandermondeMixer,
    summary="Vandermonde matrix mixer (data-dependent), the DFT or a learned Vandermonde (data-independent)",
    matrix_class="Vandermonde",
    direction="either",
    complexity="O(L^2) (materialized)",
    data_dependent="option",
    stepping=True,
    test_options={"head_dim": 16, "qk_dim": 4},
)
