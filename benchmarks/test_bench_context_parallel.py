"""Context parallelism's memory: per-rank peak of a quasiseparable mixer's forward + backward on one long
sequence, split over 1, 2 and 4 gloo ranks (CPU, float32, dim 256, the mixer's default sizes).

Also times the exchange: each rank runs the context-parallel mixer and the plain mixer on its own segment
alone (same length, no collectives); the difference is the cost of the halo/state exchange and the boundary
terms. With benchmarking enabled (``pytest benchmarks``, no ``--benchmark-disable``) the sequence has 65536
tokens and the 4-rank peak must be below half the single-process peak; under ``--benchmark-disable`` (CI) a
short sequence only checks that the benchmark runs.

Prints a table (``-s``) such as::

    ranks  tokens/rank  peak MiB/rank  fwd+bwd s  plain s  exchange overhead
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

#: Tokens of the benchmarked sequence (``MIXER_PLUGINS_CP_BENCH_TOKENS`` overrides it) and of the CI smoke run.
LONG = int(os.environ.get("MIXER_PLUGINS_CP_BENCH_TOKENS", 65536))
SHORT = 1024
DIM = 256


def _measure(rank: int, world_size: int, length: int) -> dict:
    import mixer_plugins
    from mixer_plugins.parallel import context_parallel, sequence_bounds
    from mixer_plugins.tools.benchmarking import peak_memory

    torch.manual_seed(0)
    mixer = mixer_plugins.create_mixer("quasiseparable", DIM)
    start, stop = sequence_bounds(length, world_size)[rank]
    x = torch.randn(1, stop - start, DIM)
    cp = context_parallel(mixer)
    cp(x[:, :64]).sum().backward()          # warm-up (allocator, first-call costs)
    mixer.zero_grad(set_to_none=True)
    torch.distributed.barrier()
    with peak_memory("cpu") as mem:
        t0 = time.perf_counter()
        xi = x.clone().requires_grad_(True)
        cp(xi).sum().backward()
        t_cp = time.perf_counter() - t0
    del xi
    mixer.zero_grad(set_to_none=True)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    xi = x.clone().requires_grad_(True)
    mixer(xi).sum().backward()               # the same segment alone: no exchange, no boundary terms
    t_plain = time.perf_counter() - t0
    return {"tokens": stop - start, "peak_bytes": mem["peak_bytes"], "cp_s": t_cp, "plain_s": t_plain}


def _run(world_size: int, length: int) -> list[dict]:
    from dist_helpers import run_spawned

    return run_spawned(_measure, world_size, length)


@pytest.mark.filterwarnings("ignore:Benchmark fixture was not used")
def test_context_parallel_memory(benchmarking_enabled):
    length = LONG if benchmarking_enabled else SHORT
    rows = {w: _run(w, length) for w in (1, 2, 4)}
    print(f"\ncontext parallel, quasiseparable dim {DIM}, {length} tokens, float32, CPU gloo")
    print("ranks  tokens/rank  peak MiB/rank (max)  fwd+bwd s (max)  plain s (max)  exchange overhead")
    peaks = {}
    for w, per_rank in rows.items():
        peak = max((r["peak_bytes"] or 0) for r in per_rank)
        peaks[w] = peak
        cp_s = max(r["cp_s"] for r in per_rank)
        plain_s = max(r["plain_s"] for r in per_rank)
        print(f"{w:5d}  {per_rank[0]['tokens']:11d}  {peak / 2**20:19.1f}  {cp_s:15.2f}  {plain_s:13.2f}  "
              f"{(cp_s - plain_s) / plain_s:+17.0%}")
    if not benchmarking_enabled:
        return
    if peaks[1] == 0:
        pytest.skip("peak CPU memory cannot be measured here")
    assert peaks[4] < 0.5 * peaks[1], f"4-rank peak {peaks[4]} B is not below half of one process's {peaks[1]} B"
