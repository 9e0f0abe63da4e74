"""Progress bars of the command-line tools (tqdm, from the ``demo`` extra)."""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


def progress_bar(total: int, *, enabled: bool = True, **options: Any) -> Any:
    """A ``tqdm`` bar over ``total`` items (``options`` go to tqdm: ``desc``, ``unit``, ``leave``, ``file``), or None
    when ``enabled`` is False or tqdm is not installed: a bar is a nicety, so without tqdm a run is silent until it
    prints its results."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, dynamic_ncols=True, **options)
