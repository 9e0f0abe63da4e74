"""Distributed helpers: context parallelism for the scan mixers (one long sequence split over ranks).

* :func:`context_parallel` / :class:`ContextParallelMixer` — run a scan mixer (``quasiseparable`` and its
  ablations, ``semiseparable``) on each rank's contiguous segment of the sequence, exactly;
* :func:`sequence_bounds`, :func:`shard_sequence`, :func:`gather_sequence` — split a sequence into those
  segments and put it back together (differentiable).

Data parallelism needs nothing of ours: every mixer works under ``DistributedDataParallel`` and FSDP2's
``fully_shard`` (see ``docs/distributed.md``).
"""

from .context import (
    ContextParallelError,
    ContextParallelMixer,
    context_parallel,
    gather_sequence,
    sequence_bounds,
    shard_sequence,
    supports_context_parallel,
)

__all__ = [
    "ContextParallelError",
    "ContextParallelMixer",
    "context_parallel",
    "gather_sequence",
    "sequence_bounds",
    "shard_sequence",
    "supports_context_parallel",
]
