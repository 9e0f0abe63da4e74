"""``cauchy``: the Cauchy matrix mixer.

Data-dependent: per head ``M_ij = sum_d 1 / (exp(q_{i,d}) + exp(k_{j,d}) + c)``, the paper's
``1/(q - k + c)`` realised with positive exponential terms, applied as ``y = s M v + v`` with
``s = 1/sqrt(L qk_dim)``. Data-independent: the same with free (max_seq_len, heads, qk_dim) Q, K.

The shift ``c = softplus(c_raw)`` is learned and kept positive, so no denominator can vanish (the released
code's raw ``2 beta`` could cross ``-min(exp(q) + exp(k))`` and divide by zero). It starts at 1.0 (the
code's beta = 0.5) in the data-dependent form and at 0.01 (the paper: "c initialized to 0") in the
data-independent one.

Decoding (causal) keeps every token's keys and values; a step computes its rows of M against them.
"""

from __future__ import annotations

import math
import operator
from functools import partial, reduce

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..registry.spec import MixerSpec
from .qk_block import BlockQKContext, QKBlockConfig, QKMixerBlock, queries_and_keys

__all__ = ["CauchyConfig", "CauchyMixer", "SPEC"]

_TOL = 1e-8


def _inverse_softplus(value: float) -> float:
    return math.log(math.expm1(value))


class CauchyConfig(QKBlockConfig):
    """Options of the Cauchy mixer."""


class CauchyMixer(QKMixerBlock):
    """Cauchy matrix mixer with a learned, positive shift ``c = softplus(shift_raw)``."""

    steppable = True

    def __init__(self, config: CauchyConfig):
        super().__init__(config)
        raw = _inverse_softplus(1.0 if config.data_dependent else 0.01)
        self.shift_raw = self.free_parameter("shift_raw", (), partial(nn.init.constant_, val=raw))

    def output_scale(self) -> float:
        return 1.0 / math.sqrt(self.norm_length * self.qk_dim)

    def qk_matrix(self, q: Tensor | None, k: Tensor | None, ctx: BlockQKContext) -> Tensor:
        return self._rows(q, k)

    def qk_rows(self, q: Tensor | None, keys: Tensor | None, positions: Tensor, max_len: int) -> Tensor:
        return self._rows(q, keys)

    def _rows(self, q: Tensor | None, keys: Tensor | None) -> Tensor:
        q, keys = queries_and_keys(q, keys)
        shift = F.softplus(self.shift_raw).to(q.dtype) + _TOL
        eq = torch.exp(q).permute(0, 2, 1, 3)                                            # (b, h, t, d)
        ek = torch.exp(keys).permute(0, 2, 1, 3)                                         # (b, h, J, d)
        # summed over d one slice at a time: O(t J) memory, not O(t J qk_dim)
        return reduce(operator.add, (torch.reciprocal(eq[..., d, None] + ek[..., d, None].transpose(-1, -2) + shift)
                                     for d in range(self.qk_dim)))

    def mixer_flops(self, batch: int, length: int) -> dict[str, int]:
        h, p = self.num_heads, self.head_dim
        return {
            "apply": 2 * batch * h * length * length * p,
            # two additions, a reciprocal and a sum per (i, j, d): elementwise, not a matmul
            "matrix_elementwise": 4 * batch * h * length * length * self.qk_dim,
        }


SPEC = MixerSpec(
    name="cauchy",
    config=CauchyConfig,
    builder=CauchyMixer,
    summary="Cauchy matrix mixer sum_d 1/(e^q + e^k + c), data-dependent or free",
    matrix_class="Cauchy",
    direction="either",
    complexity="O(L^2) (materialized)",
    data_dependent="option",
    stepping=True,
    test_options={"head_dim": 16, "qk_dim": 4},
)
