"""The plan of the tiled MLR op: which (query rectangle, key rectangle) tasks cover every allowed pair once, grouped
by the levels the pairs share (see :mod:`.torch` for the construction)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

__all__ = ["LEAF_MAX", "Group", "MLRPlan", "Task", "plan_tasks"]

#: blocks of at most this many tokens, with their finer levels, form one leaf group (see :func:`plan_tasks`). Off
#: (0) by default: on CPU the leaf's per-block matmuls and elementwise passes measured slower than one flash group
#: per level (L=4096, paper levels: leaf of 64 2.1-2.4 s against 1.3-1.5 s for the four groups it replaces).
LEAF_MAX = 0


@dataclasses.dataclass(frozen=True)
class Task:
    """Queries ``[q0, q0 + q_len)`` against keys ``[k0, k0 + k_len)`` inside each of ``count`` parents of ``plen``
    tokens starting at ``start`` (parent ``p`` covers ``[start + p * plen, start + (p + 1) * plen)``)."""

    start: int
    count: int
    plen: int
    q0: int
    q_len: int
    k0: int
    k_len: int
    causal: bool  # only for diagonal tasks (q range == k range): key <= query inside the task


@dataclasses.dataclass(frozen=True)
class Group:
    """Pairs sharing exactly levels ``0..level`` (``level == -1``: none): feature width and scale of their score."""

    level: int
    width: int
    scale: float
    tasks: tuple[Task, ...]
    #: a *leaf* group (not None) covers every pair inside the level-``level`` blocks, finer levels included, with
    #: matmuls on each block: per finer level ``l``, (first feature, end feature, block size).
    inner: Optional[tuple[tuple[int, int, int], ...]] = None


@dataclasses.dataclass(frozen=True)
class MLRPlan:
    length: int
    groups: tuple[Group, ...]
    block_divide: bool = True

    def pairs(self) -> int:
        """(query, key) pairs computed per (batch, head): the causal pairs or all ``L^2``."""
        return sum(t.count * t.q_len * (t.k_len + 1) // 2 if t.causal else t.count * t.q_len * t.k_len
                   for g in self.groups for t in g.tasks)

    def score_macs(self) -> int:
        """Multiply-adds of the scores at the groups' own widths, per (batch, head)."""
        return sum((t.count * t.q_len * (t.k_len + 1) // 2 if t.causal else t.count * t.q_len * t.k_len) * g.width
                   for g in self.groups for t in g.tasks)


def _segments(start: int, end: int, size: int) -> list[tuple[int, int, int]]:
    """``[start, end)`` as (start, count, length) runs: the full pieces of ``size`` and the partial last one."""
    full, rem = divmod(end - start, size)
    runs = []
    if full:
        runs.append((start, full, size))
    if rem:
        runs.append((start + full * size, 1, rem))
    return runs


def plan_tasks(length: int, ranks: Sequence[int], block_sizes: Sequence[Optional[int]], *, causal: bool,
               block_divide: bool, dyadic: bool = True, leaf_max: int = LEAF_MAX) -> MLRPlan:
    """The groups and tasks that cover every allowed (query, key) pair of a length-``length`` sequence once.

    ``dyadic``: cover the global parent with a few large rectangles (halving virtual levels) instead of one query
    tile per child (the flash engine never materializes a rectangle's scores; the matmul engine does, so it keeps
    rectangles of ``child x length``). Levels inside blocks of at most ``leaf_max`` tokens are computed together,
    block by block (a leaf group), instead of one group per level: their blocks are too small to repay a group."""
    sizes = [None if s is None or s >= length else int(s) for s in block_sizes]
    n = len(sizes)
    num_global = next((i for i, s in enumerate(sizes) if s is not None), n)
    widths = [sum(ranks[: m + 1]) for m in range(n)]

    def divisor(m: int) -> float:
        return 1.0 / (m + 1) if block_divide and m >= 0 else 1.0

    def child_tasks(parents, child):
        tasks = []
        for start, count, plen in parents:
            for a in range(math.ceil(plen / child)):
                q0 = a * child
                q_len = min(child, plen - q0)
                if q0 > 0:
                    tasks.append(Task(start, count, plen, q0, q_len, 0, q0, False))
                after = plen - q0 - q_len
                if not causal and after > 0:
                    tasks.append(Task(start, count, plen, q0, q_len, q0 + q_len, after, False))
        return tasks

    leaf = next((j for j in range(num_global, n - 1) if sizes[j] <= leaf_max), None)
    groups = []
    # group m: parents at level m (the whole sequence for m = num_global - 1), children at level m + 1
    for m in range(num_global - 1, n - 1 if leaf is None else leaf):
        child = sizes[m + 1]
        if m < num_global and dyadic:
            # One parent, the whole sequence, with many children: split it dyadically instead (virtual levels of
            # child * 2^k tokens, same width and scale), so a few large batched rectangles cover its pairs.
            chain = [length]
            while chain[-1] > 2 * child:
                chain.append(child * 2 ** math.ceil(math.log2(chain[-1] / child) - 1))
            chain.append(child)
            tasks = []
            for parent, sub in zip(chain[:-1], chain[1:]):
                tasks += child_tasks(_segments(0, length, parent), sub)
        else:
            parents = [(0, 1, length)] if m < num_global else _segments(0, length, sizes[m])
            tasks = child_tasks(parents, child)
        groups.append(Group(m, widths[m] if m >= 0 else 0, divisor(m), tuple(tasks)))
    if leaf is not None:
        inner = tuple((widths[l - 1], widths[l], sizes[l]) for l in range(leaf + 1, n))
        groups.append(Group(leaf, widths[leaf], divisor(leaf), tuple(
            Task(s, c, p, 0, p, 0, p, causal) for s, c, p in _segments(0, length, sizes[leaf])), inner))
        return MLRPlan(length, tuple(g for g in groups if g.tasks), block_divide)
    finest = sizes[-1]
    diag = [(0, 1, length)] if finest is None else _segments(0, length, finest)
    groups.append(Group(n - 1, widths[-1], divisor(n - 1),
                        tuple(Task(s, c, p, 0, p, 0, p, causal) for s, c, p in diag)))
    return MLRPlan(length, tuple(g for g in groups if g.tasks), block_divide)


