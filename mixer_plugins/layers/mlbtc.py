"""MLBTC: multi-level block tensor contraction, one structured-matrix module of which low rank, Kronecker, Monarch,
BTT, block-diagonal and multi-level low rank (MLR) are configurations.

A **BTC** (two-core block tensor contraction) is an ``n x m`` matrix with ``n = n1 * n2``, ``m = m1 * m2`` and a rank
``s``, whose entries are (row ``i = i1 * n2 + i2``, column ``j = j1 * m2 + j2``)::

    W[(i1, i2), (j1, j2)] = sum_{sigma < s} L[i2, i1, j1, sigma] * R[j1, j2, i2, sigma]

``R`` is block-diagonal over the ``m1`` input blocks (each maps ``m2`` inputs to ``n2 * s`` values) and ``L`` is
block-diagonal over the ``n2`` output blocks (each maps ``m1 * s`` values to ``n1`` outputs); in between sits a fixed
regrouping. Its matrix-vector product costs ``s * (n * m1 + m * n2)`` multiply-adds, which is also its parameter
count. An **MLBTC** sums levels, each one block-diagonal over ``p_l`` blocks that are BTCs::

    W = sum_l blockdiag_{k < p_l}( BTC_{l, k} )

+--------------------+---------+-------+------------------------------------------------------------+
| configuration      | levels  | p_l   | BTC                                                        |
+====================+=========+=======+============================================================+
| low rank ``U V^T`` | 1       | 1     | ``m1 = n2 = 1``, ``s = rank``                              |
| dense              | 1       | 1     | ``m1 = n2 = 1``, ``s = min(n, m)``                         |
| Kronecker ``A (x) B`` | 1    | 1     | ``s = 1``, ``L`` shared over ``i2``, ``R`` shared over ``j1`` |
| Monarch            | 1       | 1     | ``s = 1``                                                  |
| BTT (rank ``s``)   | 1       | 1     | general                                                    |
| block-diagonal     | 1       | p     | dense blocks                                               |
| MLR (ranks ``r_l``)| L       | 2^l   | low-rank blocks: ``m1 = n2 = 1``, ``s = r_l``              |
+--------------------+---------+-------+------------------------------------------------------------+

This construction is ours (the paper names MLBTC; its exact definition was not available to us) and it covers every
case the paper lists except Butterfly; the fixed permutations are the identity. ``btt_attention`` uses an MLBTC (one
BTT level, heads folded into ``n2``) as its key transform, and the muP rules (:mod:`mixer_plugins.layers.mup`) know each
core's fan-in: ``m2`` for ``R`` and ``m1 * s`` for ``L``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from functools import reduce
from typing import Any

import torch
from torch import Tensor, nn

from .mup import rms_cap

__all__ = ["BTCLevel", "MLBTC", "factorize"]


def factorize(n: int) -> tuple[int, int]:
    """``(c, d)`` with ``c * d = n`` and ``d`` the smallest divisor of ``n`` strictly above ``sqrt(n)``.

    This is the structured-attention code's rule: 64 -> (4, 16), 256 -> (8, 32), 768 -> (24, 32). A prime ``n`` (and
    ``n = 1``) gives ``(1, n)``.
    """
    if n <= 0:
        raise ValueError(f"factorize needs a positive integer, got {n}")
    root = math.isqrt(n)
    for d in range(root + 1, n + 1):
        if n % d == 0:
            return n // d, d
    return 1, n


@dataclasses.dataclass(frozen=True)
class BTCLevel:
    """One MLBTC level: ``blocks`` diagonal blocks, each a BTC of shape ``(n1 * n2) x (m1 * m2)`` and rank ``rank``.

    ``kronecker=True`` ties the cores so that each block is ``A (x) B`` summed over ``rank`` terms: ``L`` does not
    depend on ``i2`` and ``R`` does not depend on ``j1``.
    """

    out_factors: tuple[int, int]
    in_factors: tuple[int, int]
    rank: int = 1
    blocks: int = 1
    kronecker: bool = False

    def __post_init__(self) -> None:
        for what, value in (("out_factors", self.out_factors), ("in_factors", self.in_factors)):
            if len(value) != 2 or any(int(v) != v or v <= 0 for v in value):
                raise ValueError(f"BTCLevel.{what} must be two positive integers, got {value!r}")
        object.__setattr__(self, "out_factors", tuple(int(v) for v in self.out_factors))
        object.__setattr__(self, "in_factors", tuple(int(v) for v in self.in_factors))
        if self.rank <= 0:
            raise ValueError(f"BTCLevel.rank must be positive, got {self.rank}")
        if self.blocks <= 0:
            raise ValueError(f"BTCLevel.blocks must be positive, got {self.blocks}")

    @property
    def out_features(self) -> int:
        return self.blocks * self.out_factors[0] * self.out_factors[1]

    @property
    def in_features(self) -> int:
        return self.blocks * self.in_factors[0] * self.in_factors[1]

    def left_shape(self) -> tuple[int, ...]:
        """``L``: (blocks, n2, n1, m1, rank); ``n2`` is 1 when tied (Kronecker)."""
        (n1, n2), (m1, _) = self.out_factors, self.in_factors
        return (self.blocks, 1 if self.kronecker else n2, n1, m1, self.rank)

    def right_shape(self) -> tuple[int, ...]:
        """``R``: (blocks, m1, m2, n2, rank); ``m1`` is 1 when tied (Kronecker)."""
        (_, n2), (m1, m2) = self.out_factors, self.in_factors
        return (self.blocks, 1 if self.kronecker else m1, m2, n2, self.rank)

    def left_fan_in(self) -> int:
        return self.in_factors[0] * self.rank

    def right_fan_in(self) -> int:
        return self.in_factors[1]

    def macs_per_vector(self) -> int:
        """Multiply-adds of one matrix-vector product: ``s * (n * m1 + m * n2)``."""
        (n1, n2), (m1, m2) = self.out_factors, self.in_factors
        return self.blocks * self.rank * (n1 * n2 * m1 + m1 * m2 * n2)


class MLBTC(nn.Module):
    """A structured ``out_features x in_features`` matrix: a sum of block-diagonal BTC levels.

    ``forward(x)`` applies it to the last axis of ``x`` (like ``nn.Linear`` without bias: ``x @ W.T``);
    :meth:`to_dense` returns ``W``. Parameters are ``left_<l>`` and ``right_<l>`` per level (shapes in
    :class:`BTCLevel`), initialised ``N(0, 1/fan_in)`` with ``fan_in`` = ``m1 * s`` and ``m2`` (the muP init, which
    keeps each contraction's output at unit scale). ``rms_cap=True`` rescales each core in the forward pass by
    :func:`mixer_plugins.layers.mup.rms_cap`.

    Named configurations: :meth:`low_rank`, :meth:`dense`, :meth:`kronecker`, :meth:`monarch`, :meth:`btt`,
    :meth:`block_diagonal`, :meth:`mlr`.
    """

    def __init__(self, levels: Sequence[BTCLevel], *, rms_cap: bool = False):
        super().__init__()
        levels = list(levels)
        if not levels:
            raise ValueError("MLBTC needs at least one level")
        outs = {lv.out_features for lv in levels}
        ins = {lv.in_features for lv in levels}
        if len(outs) != 1 or len(ins) != 1:
            shapes = [f"{lv.out_features}x{lv.in_features}" for lv in levels]
            raise ValueError(f"every MLBTC level must have the same shape, got {shapes}")
        self.levels = levels
        self.out_features = outs.pop()
        self.in_features = ins.pop()
        self.rms_cap = rms_cap
        self.mup_fan_in: dict[str, int] = {}
        for i, lv in enumerate(levels):
            self.register_parameter(f"left_{i}", nn.Parameter(torch.empty(lv.left_shape())))
            self.register_parameter(f"right_{i}", nn.Parameter(torch.empty(lv.right_shape())))
            self.mup_fan_in[f"left_{i}"] = lv.left_fan_in()
            self.mup_fan_in[f"right_{i}"] = lv.right_fan_in()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every core ``N(0, 1/fan_in)`` (level by level, left core first)."""
        for i, lv in enumerate(self.levels):
            getattr(self, f"left_{i}").normal_(0.0, 1.0 / math.sqrt(lv.left_fan_in()))
            getattr(self, f"right_{i}").normal_(0.0, 1.0 / math.sqrt(lv.right_fan_in()))

    # -- named configurations -----------------------------------------------------------------------------------------
    @classmethod
    def low_rank(cls, out_features: int, in_features: int, rank: int, **kwargs: Any) -> MLBTC:
        """``W = U V^T`` with ``U = left_0[0, 0, :, 0, :]`` (n x r) and ``V = right_0[0, 0, :, 0, :]`` (m x r)."""
        return cls([BTCLevel((out_features, 1), (1, in_features), rank)], **kwargs)

    @classmethod
    def dense(cls, out_features: int, in_features: int, **kwargs: Any) -> MLBTC:
        """Any ``n x m`` matrix: low rank with rank ``min(n, m)``."""
        return cls.low_rank(out_features, in_features, min(out_features, in_features), **kwargs)

    @classmethod
    def kronecker(cls, a_shape: tuple[int, int], b_shape: tuple[int, int], rank: int = 1, **kwargs: Any) -> MLBTC:
        """``W = sum_sigma A_sigma (x) B_sigma`` with ``A`` of shape ``a_shape`` (``n1 x m1``) and ``B`` of ``b_shape``
        (``n2 x m2``): ``A_sigma = left_0[0, 0, :, :, sigma]``, ``B_sigma[i2, j2] = right_0[0, 0, j2, i2, sigma]``."""
        (n1, m1), (n2, m2) = a_shape, b_shape
        return cls([BTCLevel((n1, n2), (m1, m2), rank, kronecker=True)], **kwargs)

    @classmethod
    def monarch(cls, out_factors: tuple[int, int], in_factors: tuple[int, int], **kwargs: Any) -> MLBTC:
        """Monarch ``P_L L P_R R``: a BTC of rank 1."""
        return cls([BTCLevel(out_factors, in_factors, 1)], **kwargs)

    @classmethod
    def btt(cls, out_factors: tuple[int, int], in_factors: tuple[int, int], rank: int, **kwargs: Any) -> MLBTC:
        """Block tensor-train of rank ``rank`` (Monarch when 1)."""
        return cls([BTCLevel(out_factors, in_factors, rank)], **kwargs)

    @classmethod
    def block_diagonal(cls, out_features: int, in_features: int, blocks: int, **kwargs: Any) -> MLBTC:
        """``blockdiag`` of ``blocks`` dense blocks (``blocks`` must divide both sizes)."""
        if out_features % blocks or in_features % blocks:
            raise ValueError(f"blocks={blocks} must divide out_features={out_features} and in_features={in_features}")
        n, m = out_features // blocks, in_features // blocks
        return cls([BTCLevel((n, 1), (1, m), min(n, m), blocks=blocks)], **kwargs)

    @classmethod
    def mlr(cls, out_features: int, in_features: int, ranks: Sequence[int], blocks: Sequence[int] | None = None,
            **kwargs: Any) -> MLBTC:
        """Multi-level low rank: level ``l`` is block-diagonal over ``blocks[l]`` (default ``2**l``) blocks of rank
        ``ranks[l]``."""
        blocks = list(blocks) if blocks is not None else [2**level for level in range(len(ranks))]
        if len(blocks) != len(ranks):
            raise ValueError(f"ranks ({len(ranks)} levels) and blocks ({len(blocks)} levels) differ in length")
        levels = []
        for rank, p in zip(ranks, blocks):
            if out_features % p or in_features % p:
                raise ValueError(f"{p} blocks do not divide out_features={out_features} and in_features={in_features}")
            levels.append(BTCLevel((out_features // p, 1), (1, in_features // p), rank, blocks=p))
        return cls(levels, **kwargs)

    # -- the matrix ---------------------------------------------------------------------------------------------------
    def cores(self, level: int) -> tuple[Tensor, Tensor]:
        """The effective ``(L, R)`` of a level, expanded over tied axes and RMS-capped when ``rms_cap``."""
        lv = self.levels[level]
        (n1, n2), (m1, m2) = lv.out_factors, lv.in_factors
        left, right = getattr(self, f"left_{level}"), getattr(self, f"right_{level}")
        if self.rms_cap:
            left = rms_cap(left, lv.left_fan_in(), n1)
            right = rms_cap(right, lv.right_fan_in(), n2 * lv.rank)
        return left.expand(lv.blocks, n2, n1, m1, lv.rank), right.expand(lv.blocks, m1, m2, n2, lv.rank)

    def forward(self, x: Tensor) -> Tensor:
        """``x @ W.T`` over the last axis: (..., in_features) -> (..., out_features)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MLBTC expects a last axis of {self.in_features}, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]

        def level(i: int) -> Tensor:
            left, right = self.cores(i)
            xb = x.reshape(*lead, self.levels[i].blocks, *self.levels[i].in_factors)
            # R: contract each input block's m2 entries -> (.., p, m1, n2, s); then L: contract (m1, s) -> n1.
            u = torch.einsum("...pab,pabcs->...pacs", xb, right)
            return torch.einsum("...pacs,pcdas->...pdc", u, left).reshape(*lead, self.out_features)

        return reduce(operator.add, (level(i) for i in range(len(self.levels))))

    def level_dense(self, level: int) -> Tensor:
        """The ``out_features x in_features`` matrix of one level."""
        lv = self.levels[level]
        left, right = self.cores(level)
        (n1, n2), (m1, m2) = lv.out_factors, lv.in_factors
        blocks = torch.einsum("pcdas,pabcs->pdcab", left, right).reshape(lv.blocks, n1 * n2, m1 * m2)
        return torch.block_diag(*blocks.unbind(0))

    def to_dense(self) -> Tensor:
        """``W``, (out_features, in_features)."""
        return reduce(operator.add, (self.level_dense(i) for i in range(len(self.levels))))

    def macs_per_vector(self) -> int:
        """Multiply-adds of one matrix-vector product (the FLOPs of ``forward`` are twice this per vector)."""
        return sum(lv.macs_per_vector() for lv in self.levels)

    def extra_repr(self) -> str:
        parts = [
            f"p={lv.blocks} n=({lv.out_factors[0]}x{lv.out_factors[1]}) m=({lv.in_factors[0]}x{lv.in_factors[1]}) "
            f"s={lv.rank}" + (" kron" if lv.kronecker else "")
            for lv in self.levels
        ]
        return f"{self.out_features}x{self.in_features}, levels=[{'; '.join(parts)}], rms_cap={self.rms_cap}"
