"""Tiles: the pieces along time that the CPU paths work through one at a time.

On CPU every full-size temporary is a fresh allocation (glibc serves large ones with ``mmap``), whose page
faults can cost more than the arithmetic. So the depthwise conv and the gated norm cut the
sequence into tiles whose temporaries stay near an element budget: small, in cache, and reused by the
allocator. The tile size changes speed only, never the result.
"""

from __future__ import annotations

import torch

__all__ = ["tile_bounds", "tile_length", "time_tiles"]


def tile_length(budget: int, item_elements: int) -> int:
    """Items (rows, time steps or chunks) per tile: as many of ``item_elements`` each as fit in ``budget``
    elements, and never fewer than one."""
    return max(1, budget // max(1, item_elements))


def tile_bounds(total: int, length: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of tiles of ``length`` items covering ``total``, left to right (the last may be
    shorter)."""
    return [(s, min(s + length, total)) for s in range(0, total, length)]


def time_tiles(total: int, item_elements: int, budget: int, device: torch.device) -> list[tuple[int, int]]:
    """The tiles of a CPU pass over ``total`` items; one tile on other devices (GPU allocators cache, and a
    loop of small kernels would only add launches)."""
    if device.type != "cpu":
        return [(0, total)]
    return tile_bounds(total, tile_length(budget, item_elements))

