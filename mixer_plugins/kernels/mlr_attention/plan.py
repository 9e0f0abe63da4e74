"""The plan of the tiled MLR op: which (query rectangle, key rectangle) tasks cover every allowed pair once, grouped
by the levels the pairs share (see :mod:`.torch` for the construction)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["Group", "MLRPlan", "Task", "TilePlan", "plan_tasks", "tile_classes", "tile_plan"]


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


@dataclasses.dataclass(frozen=True)
class MLRPlan:
    length: int
    groups: tuple[Group, ...]


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
               block_divide: bool, dyadic: bool = True) -> MLRPlan:
    """The groups and tasks that cover every allowed (query, key) pair of a length-``length`` sequence once.

    ``dyadic``: cover the global parent with a few large rectangles (halving virtual levels) instead of one query
    tile per child (rectangles of ``child x length``)."""
    sizes = [None if s is None or s >= length else int(s) for s in block_sizes]
    n = len(sizes)
    num_global = next((i for i, s in enumerate(sizes) if s is not None), n)
    widths = [sum(ranks[: m + 1]) for m in range(n)]

    def block(m: int) -> int:   # the block size of a level past the global ones (the levels nest: all are sized)
        size = sizes[m]
        assert size is not None, "a global level has no block size"
        return size

    def divisor(m: int) -> float:
        return 1.0 / (m + 1) if block_divide and m >= 0 else 1.0

    def child_tasks(parents: list[tuple[int, int, int]], child: int) -> list[Task]:
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

    groups = []
    # group m: parents at level m (the whole sequence for m = num_global - 1), children at level m + 1
    for m in range(num_global - 1, n - 1):
        child = block(m + 1)
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
            parents = [(0, 1, length)] if m < num_global else _segments(0, length, block(m))
            tasks = child_tasks(parents, child)
        groups.append(Group(m, widths[m] if m >= 0 else 0, divisor(m), tuple(tasks)))
    finest = sizes[-1]
    diag = [(0, 1, length)] if finest is None else _segments(0, length, finest)
    groups.append(Group(n - 1, widths[-1], divisor(n - 1),
                        tuple(Task(s, c, p, 0, p, 0, p, causal) for s, c, p in diag)))
    return MLRPlan(length, tuple(g for g in groups if g.tasks))


# -- the tile plan of the Triton kernels --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Which column tiles each row tile of a Triton MLR kernel visits, and how (built by :func:`tile_plan`).

    Rows are the tiles a program holds (queries in the forward and the dq kernel, keys in the dk/dv kernel), columns
    the tiles it streams. A (row tile, column tile) pair is either skipped (no allowed pair), *uniform* (every pair
    allowed, the tail tile excluded, and every level either holds both tiles in one block or neither: all its pairs
    share the same levels ``0..m``, so their scores are one unmasked dot of width ``W_m = r_0 + ... + r_m``), or
    *mixed* (a per-entry mask: a block boundary inside the pair, the causal diagonal, a band edge, the partial last
    tile). Uniform pairs are grouped by class (``classes[c]`` = the number of shared levels, 0 = none) into runs of
    consecutive column tiles; a kernel loops over the classes (each a compile-time width), over the class's runs, and
    over each run's tiles (a pipelined loop).

    ``seg_ptr`` (int32, ``rows * len(classes) + 1``): row ``r``'s runs of class ``c`` are ``segs[seg_ptr[r * C + c]
    : seg_ptr[r * C + c + 1]]``; ``segs`` (int32, (n, 2)): [first, end) column tile of each run; row ``r``'s mixed
    column tiles are ``mixed[mixed_ptr[r] : mixed_ptr[r + 1]]``.
    """

    row_tile: int
    col_tile: int
    n_rows: int
    classes: tuple[int, ...]
    seg_ptr: torch.Tensor
    segs: torch.Tensor
    mixed_ptr: torch.Tensor
    mixed: torch.Tensor

    def pair_counts(self) -> dict[str, int]:
        """Tile pairs by kind: ``uniform`` and ``mixed`` (the skipped ones are neither)."""
        runs = self.segs[:, 1] - self.segs[:, 0]
        return {"uniform": int(runs.sum()), "mixed": int(self.mixed.numel())}


def tile_classes(block_sizes: Sequence[Optional[int]]) -> tuple[int, ...]:
    """The classes of uniform tile pairs (numbers of shared levels) a level list can have, in kernel order: ``1 ..
    n``, and 0 (pairs that share no level) when level 0 is not global. Independent of the length, so the kernels'
    compile-time specialization is too."""
    n = len(block_sizes)
    return tuple(range(1, n + 1)) + ((0,) if block_sizes[0] is not None else ())


def tile_plan(length: int, row_tile: int, col_tile: int, block_sizes: Sequence[Optional[int]], *, causal: bool,
              keys_are_rows: bool = False, window: Optional[int] = None, num_global: int = 0) -> TilePlan:
    """The :class:`TilePlan` of a length-``length`` sequence cut into ``row_tile`` rows and ``col_tile`` columns.

    ``keys_are_rows``: rows are key tiles and columns query tiles (the dk/dv kernel); otherwise rows are queries.
    ``window`` (not None): only pairs with ``|i - j| <= window``, or ``i`` or ``j`` among the first ``num_global``
    tokens, are allowed (local attention). Built from tile bounds alone (never from tensor values)."""
    n_rows = -(-length // row_tile)
    n_cols = -(-length // col_tile)
    r0 = torch.arange(n_rows, dtype=torch.int64)[:, None] * row_tile
    r1 = torch.clamp(r0 + row_tile, max=length) - 1
    c0 = torch.arange(n_cols, dtype=torch.int64)[None, :] * col_tile
    c1 = torch.clamp(c0 + col_tile, max=length) - 1
    a0, a1, b0, b1 = (c0, c1, r0, r1) if keys_are_rows else (r0, r1, c0, c1)  # a: queries, b: keys
    shape = (n_rows, n_cols)
    skip = torch.zeros(shape, dtype=torch.bool)
    mixed = (c1 - c0 + 1 < col_tile).expand(shape).clone()  # the partial last column tile: masked loads
    depth = torch.zeros(shape, dtype=torch.int64)  # leading levels whose one block holds both tiles
    prefix = torch.ones(shape, dtype=torch.bool)
    for size in block_sizes:
        if size is None or size >= length:
            depth += prefix
            continue
        whole = (a0 // size == a1 // size) & (b0 // size == a0 // size) & (b1 // size == a0 // size)
        apart = (a1 // size < b0 // size) | (b1 // size < a0 // size)
        mixed |= ~(whole | apart)
        prefix = prefix & whole
        depth += prefix
    if causal:
        skip |= (b0 > a1).expand(shape)
        mixed |= ~(b1 <= a0).expand(shape)
    if window is not None:
        g = num_global
        inside = (torch.maximum(a1 - b0, b1 - a0) <= window) | (a1 < g) | (b1 < g)
        gap = torch.clamp(torch.maximum(b0 - a1, a0 - b1), min=0)
        skip |= ((gap > window) & (a0 >= g) & (b0 >= g)).expand(shape)
        mixed |= ~inside.expand(shape)
    classes = tile_classes(block_sizes)
    position = torch.full((len(block_sizes) + 1,), -1, dtype=torch.int64)
    position[list(classes)] = torch.arange(len(classes))
    code = torch.where(skip, -2, torch.where(mixed, -1, position[depth]))
    # runs of equal codes along each row; keep the uniform ones
    start = torch.ones(shape, dtype=torch.bool)
    start[:, 1:] = code[:, 1:] != code[:, :-1]
    flat = start.flatten().nonzero().flatten()
    ends = torch.cat([flat[1:], torch.tensor([n_rows * n_cols])])
    rows = flat // n_cols
    ends = torch.minimum(ends, (rows + 1) * n_cols) - rows * n_cols
    firsts = flat - rows * n_cols
    run_code = code.flatten()[flat]
    keep = run_code >= 0
    rows, firsts, ends, run_code = rows[keep], firsts[keep], ends[keep], run_code[keep]
    key = rows * len(classes) + run_code
    order = torch.argsort(key, stable=True)
    seg_ptr = torch.zeros(n_rows * len(classes) + 1, dtype=torch.int64)
    seg_ptr[1:] = torch.cumsum(torch.bincount(key, minlength=n_rows * len(classes)), 0)
    segs = torch.stack([firsts[order], ends[order]], 1)
    mixed_rows, mixed_cols = (code == -1).nonzero(as_tuple=True)
    mixed_ptr = torch.zeros(n_rows + 1, dtype=torch.int64)
    mixed_ptr[1:] = torch.cumsum(torch.bincount(mixed_rows, minlength=n_rows), 0)
    i32 = torch.int32
    return TilePlan(row_tile, col_tile, n_rows, classes, seg_ptr.to(i32), segs.to(i32).reshape(-1, 2),
                    mixed_ptr.to(i32), mixed_cols.to(i32))
