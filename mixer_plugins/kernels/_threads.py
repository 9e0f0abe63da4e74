"""Threads per op size: the CPU paths run their small ops on one thread.

Every PyTorch CPU op larger than its grain size (32768 elements) is a parallel region, and a parallel region
ends only when every thread of the team has finished its share. When the cores are shared (data-loader
workers, another job), one of those threads is often descheduled and the region waits for it for a whole
scheduler time slice, however little work it had: a path made of thousands of small parallel ops then slows
down far more than a path of a few large ones, such as SDPA. So the scan, the short convolution and the gated
norm run a section whose ops are small (:data:`PARALLEL_MIN_ELEMENTS`) on one thread, and only sections of
large ops on all of ``torch.get_num_threads()``. The setting is changed for the section and restored after it
(``torch.set_num_threads`` costs about a microsecond); it changes speed only, never a result.

The threshold is :data:`PARALLEL_MIN_ELEMENTS`, or the environment variable ``MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS``
when set (read at every section): raise it on a machine whose cores are always shared (everything small and
medium then runs on one thread), lower it (e.g. to 0) on a dedicated one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["PARALLEL_MIN_ELEMENTS", "parallel_min_elements", "section_threads", "threads_for"]

#: Below this many elements in the largest tensor an op of the section writes, the section runs on one thread.
#: (An elementwise op of 2^20 float32 elements takes about half a millisecond on one core. Measured on 2 cores,
#: 2^20 kept the slowdown under a competing process within the benchmark's bound at L = 1024 and 4096 while
#: losing less quiet-machine speed than 2^21: see docs/performance.md.)
PARALLEL_MIN_ELEMENTS = 1 << 20


def parallel_min_elements() -> int:
    """The threshold in force: ``MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS`` when it is a non-negative integer, else
    :data:`PARALLEL_MIN_ELEMENTS`."""
    value = os.environ.get("MIXER_PLUGINS_PARALLEL_MIN_ELEMENTS", "").strip()
    if value.isdigit():
        return int(value)
    return PARALLEL_MIN_ELEMENTS


def section_threads(elements: int, device: torch.device | str | None) -> int:
    """Threads for a section whose largest op writes ``elements`` elements on ``device``: one for small
    sections on CPU, else the current ``torch.get_num_threads()``."""
    threads = torch.get_num_threads()
    if device is not None and torch.device(device).type != "cpu":
        return threads
    return 1 if elements < parallel_min_elements() else threads


@contextlib.contextmanager
def threads_for(elements: int, device: torch.device | str | None) -> Iterator[int]:
    """Run the body with :func:`section_threads` intra-op threads (restored on exit); yields that number."""
    current = torch.get_num_threads()
    wanted = section_threads(elements, device)
    if wanted == current:
        yield current
        return
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(current)
