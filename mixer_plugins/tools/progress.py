"""Progress bars of the command-line tools (tqdm, from the ``demo`` extra)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(total: int, *, enabled: bool = True, **options: Any) -> Iterator[Any]:
    """``with progress_bar(total) as bar``: a ``tqdm`` bar over ``total`` items (``options`` go to tqdm: ``desc``,
    ``unit``, ``leave``, ``file``), closed at the end of the block; None when ``enabled`` is False or tqdm is not
    installed: a bar is a nicety, so without tqdm a run is silent until it prints its results."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield None
        return
    bar = tqdm(total=total, dynamic_ncols=True, **options)
    try:
        yield bar
    finally:
        bar.close()
