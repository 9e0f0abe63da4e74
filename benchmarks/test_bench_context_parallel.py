"""Context parallelism: per-rank peak memory and the time of the exchange, on 1, 2 and 4 gloo ranks (CPU).

One long sequence (batch 1, dim 256, float32, the mixers' default sizes), forward + backward, for
``quasiseparable`` (Hydra) and ``semiseparable`` (causal SSD):

* **memory**: the per-rank peak resident-set growth (``mixer_plugins.tools.benchmarking.peak_memory``: what a
  normal process sees, malloc untuned) of the first forward + backward. On 1 rank it is the plain mixer in
  one process (no process group work at all), on 2 and 4 ranks the context-parallel wrapper on the rank's
  segment. Target: at 65536 tokens, 4 ranks <= 0.35x one process.
* **time**: per repetition (all ranks start together after a barrier), forward + backward of

  - ``local``: the plain mixer on the rank's segment alone (the local scan, no collectives);
  - ``halo``: the halo exchange alone (``_widen``: the integer all-gather, the all-gather of the border rows,
    the widened segment; and its backward);
  - ``states``: the state exchange alone (``_combine_states``: all-gather of the packed segment states and
    total decays at the real size, prefix/suffix combine; and its backward);
  - ``cp``: the whole context-parallel forward + backward (local scan + exchange + boundary terms).

  Each figure is the slowest rank's (a step waits for it); the table gives the median over repetitions and
  the min-max spread.

With benchmarking enabled (``pytest benchmarks/test_bench_context_parallel.py -s``, no ``--benchmark-disable``)
the sequence has 65536 tokens (``MIXER_PLUGINS_CP_BENCH_TOKENS`` overrides it) and the memory target is
asserted; under ``--benchmark-disable`` (CI) a short sequence only checks that everything runs.

One configuration at a time, printed as a JSON line (what the tables in ``docs/distributed.md`` came from)::

    python benchmarks/test_bench_context_parallel.py --mixer quasiseparable --ranks 4 --tokens 65536 --reps 3
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

#: Tokens of the benchmarked sequence (``MIXER_PLUGINS_CP_BENCH_TOKENS`` overrides it) and of the CI smoke run.
LONG = int(os.environ.get("MIXER_PLUGINS_CP_BENCH_TOKENS", 65536))
SHORT = 512
DIM = 256
MIXERS = ("quasiseparable", "semiseparable")
WORLDS = (1, 2, 4)
#: The target: per-rank peak on 4 ranks at most this fraction of one process's.
TARGET_4_RANKS = 0.35


def _fwd_bwd(fn, *tensors) -> None:
    out = fn(*tensors)
    if isinstance(out, (list, tuple)):
        out = sum(o.sum() for o in out)
    out.sum().backward()


def _timed(fn, *tensors) -> float:
    torch.distributed.barrier()
    t0 = time.perf_counter()
    _fwd_bwd(fn, *tensors)
    return time.perf_counter() - t0


def _halo(cp, x: torch.Tensor) -> torch.Tensor:
    return cp._widen(x, None)[0]


def _measure(rank: int, world_size: int, mixer_names: tuple[str, ...], length: int, reps: int) -> dict:
    """On one rank: peak memory of the first forward + backward, then ``reps`` timed repetitions."""
    import mixer_plugins
    from mixer_plugins.parallel import context_parallel, sequence_bounds
    from mixer_plugins.tools.benchmarking import peak_memory

    results = {}
    for name in mixer_names:
        torch.manual_seed(0)
        mixer = mixer_plugins.create_mixer(name, DIM)
        start, stop = sequence_bounds(length, world_size)[rank]
        x = torch.randn(1, stop - start, DIM)
        cp = context_parallel(mixer)
        run = mixer if world_size == 1 else cp          # one process: the plain mixer, nothing distributed
        _fwd_bwd(cp, x[:, :64].clone().requires_grad_(True))     # warm-up (allocator, first-call costs)
        _fwd_bwd(mixer, x[:, :64].clone().requires_grad_(True))
        mixer.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        with peak_memory("cpu") as mem:
            _fwd_bwd(run, x.clone().requires_grad_(True))
        mixer.zero_grad(set_to_none=True)

        # the packed states at their real size: (directions, batch, heads, head_dim * d_state + 1)
        ctx = mixer.prepare(x[:, :8], None)
        heads, p, n = (ctx.x if cp.bidirectional else ctx.values).shape[2], mixer.head_dim, mixer.d_state
        del ctx
        directions = 2 if cp.bidirectional else 1
        packed = torch.rand(directions, 1, heads, p * n + 1)
        reverse = [False, True][:directions]
        parts = {
            "local": (mixer, x),
            "halo": (functools.partial(_halo, cp), x),
            "states": (functools.partial(cp._combine_states, reverse=reverse, p=p, n=n), packed),
            "cp": (cp, x),
        }
        times: dict[str, list[float]] = {part: [] for part in parts}
        for _ in range(reps):      # interleaved, so that load from other jobs hits every figure alike
            for part, (fn, inp) in parts.items():
                times[part].append(_timed(fn, inp.clone().requires_grad_(True)))
            mixer.zero_grad(set_to_none=True)
        results[name] = {"tokens": stop - start, "peak_bytes": mem["peak_bytes"], "times": times}
    return results


def run_config(mixer_names: tuple[str, ...], world_size: int, length: int, reps: int) -> dict:
    """Spawn ``world_size`` gloo ranks and measure; per mixer: peak bytes (largest rank), tokens per rank and,
    per timed part, the slowest rank's seconds for each repetition."""
    from helpers import run_spawned

    per_rank = run_spawned(_measure, world_size, tuple(mixer_names), length, reps)
    out = {}
    for name in mixer_names:
        rows = [r[name] for r in per_rank]
        peaks = [r["peak_bytes"] for r in rows]
        out[name] = {
            "ranks": world_size, "length": length, "tokens_per_rank": rows[0]["tokens"],
            "peak_bytes": None if None in peaks else max(peaks),
            "times": {part: [max(r["times"][part][i] for r in rows) for i in range(reps)]
                      for part in rows[0]["times"]},
        }
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def _print_tables(rows: dict[str, dict[int, dict]]) -> None:
    for name, per_world in rows.items():
        one = per_world[1]
        print(f"\n{name}, dim {DIM}, {one['length']} tokens, float32, CPU gloo, fwd+bwd "
              "(seconds: median [min-max] of the slowest rank)")
        print("ranks  tokens/rank  peak MiB/rank  x one process  local s  halo s  states s  cp s  "
              "(halo+states)/local")
        for w, r in per_world.items():
            t = r["times"]
            ratio = [(h + s) / loc for h, s, loc in zip(t["halo"], t["states"], t["local"])]
            peak = r["peak_bytes"] or 0
            print(f"{w:5d}  {r['tokens_per_rank']:11d}  {peak / 2**20:13.1f}  "
                  f"{peak / max(one['peak_bytes'] or 1, 1):13.3f}  {_spread(t['local'])}  {_spread(t['halo'])}  "
                  f"{_spread(t['states'])}  {_spread(t['cp'])}  {_spread(ratio)}")


@pytest.mark.filterwarnings("ignore:Benchmark fixture was not used")
@pytest.mark.slow  # gloo ranks in fresh processes
def test_context_parallel_memory_and_exchange(benchmarking_enabled):
    if benchmarking_enabled:    # one configuration per spawn: a process's peak is its own
        rows = {name: {w: run_config((name,), w, LONG, reps=3)[name] for w in WORLDS} for name in MIXERS}
    else:                       # CI smoke run: every mixer in one spawn per rank count, one repetition
        rows = {name: {} for name in MIXERS}
        for w in WORLDS:
            for name, r in run_config(MIXERS, w, SHORT, reps=1).items():
                rows[name][w] = r
    _print_tables(rows)
    for name, per_world in rows.items():
        for w, r in per_world.items():
            assert all(t > 0 for part in r["times"].values() for t in part), (name, w)
    if not benchmarking_enabled:
        return
    for name, per_world in rows.items():
        one, four = per_world[1]["peak_bytes"], per_world[4]["peak_bytes"]
        if not one:
            pytest.skip("peak CPU memory cannot be measured here")
        assert four <= TARGET_4_RANKS * one, (
            f"{name}: 4-rank peak {four / 2**20:.1f} MiB is above {TARGET_4_RANKS} x one process's "
            f"{one / 2**20:.1f} MiB")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="One context-parallel configuration; prints a JSON line.")
    parser.add_argument("--mixer", action="append", choices=MIXERS, help="repeatable; default: both")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=LONG)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run_config(tuple(args.mixer or MIXERS), args.ranks, args.tokens, args.reps)), flush=True)
