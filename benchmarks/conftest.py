"""Shared fixture of the benchmark suites: one mixer run timed by pytest-benchmark, with ``extra_info``
holding FLOPs counted by PyTorch's FlopCounterMode, the analytic FLOPs, achieved FLOP/s and peak memory.

Run the suites (saving JSON under .benchmarks/):   make bench
Render a comparison table from saved runs:          mixer-plugins bench-table .benchmarks
In CI they run once with --benchmark-disable, so they cannot rot: that single run goes through the same
FLOP counter as a timed run (no extra call), and its ``extra_info`` is checked.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from mixer_plugins.tools.benchmarking import build_mixer, count_flops, mixer_step, peak_memory
from mixer_plugins.tools.cli.args import positive_int


def bench_threads(environ: dict[str, str] | None = None) -> int:
    """Threads of the timed runs: ``MIXER_PLUGINS_BENCH_THREADS``, else ``OMP_NUM_THREADS`` (the usual knob, which
    torch itself honours), else one per pytest-xdist worker (the CI smoke run: two workers on two cores; two
    threads each would oversubscribe them), else every core."""
    environ = os.environ if environ is None else environ
    for variable in ("MIXER_PLUGINS_BENCH_THREADS", "OMP_NUM_THREADS"):
        value = environ.get(variable, "").strip()
        if value:
            try:
                return positive_int(value)  # the CLI's --threads parser: one rule for both
            except argparse.ArgumentTypeError:
                raise pytest.UsageError(f"{variable} must be a positive integer, got {value!r}") from None
    return 1 if environ.get("PYTEST_XDIST_WORKER") else (os.cpu_count() or 1)


torch.set_num_threads(bench_threads())


def is_disabled(benchmark) -> bool:
    return bool(getattr(benchmark, "disabled", False))


@pytest.fixture
def benchmarking_enabled(benchmark) -> bool:
    """False under --benchmark-disable (CI): timing and memory targets are then skipped."""
    return not is_disabled(benchmark)


def _check_extra_info(info: dict) -> None:
    """What ``mixer-plugins bench-table`` reads must be there and make sense."""
    assert info["flops"] > 0, f"FlopCounterMode counted no FLOPs for {info['mixer']}"
    assert info["analytic_flops"] > 0
    peak = info["peak_memory_bytes"]
    assert peak is None or peak >= 0


@pytest.fixture
def mixer_benchmark(benchmark):
    """``mixer_benchmark(name, dim=, length=, batch=, mode=)``: time one forward or forward+backward.

    Returns ``benchmark.extra_info``: ``mixer``, ``length``, ``batch``, ``dim``, ``mode``, ``flops`` (counted by
    FlopCounterMode), ``analytic_flops`` (``mixer.flops``, x3 for forward+backward), ``peak_memory_bytes`` and,
    when timed, ``flops_per_second`` and ``tokens_per_second`` (from the median time).
    """

    def run(name: str, *, dim: int, length: int, batch: int = 1, mode: str = "forward", causal=None,
            options=None, rounds: int = 3):
        torch.manual_seed(0)
        mixer = build_mixer(name, dim, length, causal=causal, options=options)
        mixer.train(mode == "forward_backward")
        x = torch.randn(batch, length, dim, requires_grad=mode == "forward_backward")
        fn = mixer_step(mixer, x, mode)
        benchmark.group = f"{mode} L={length} B={batch} D={dim}"
        analytic = mixer.flops(batch, length) * (3 if mode == "forward_backward" else 1)
        benchmark.extra_info.update(mixer=mixer.mixer_name, length=length, batch=batch, dim=dim, mode=mode,
                                    analytic_flops=analytic)
        if is_disabled(benchmark):
            # CI: a single call, through the FLOP counter a timed run uses (cheap). The peak-memory probe is left
            # out: it sends every large buffer to mmap and made this smoke run 2.5x slower;
            # tests/tools/test_bench_cli.py runs the timed path, probe included.
            measured = {}

            def once() -> None:
                measured["flops"] = count_flops(fn)

            benchmark.pedantic(once, rounds=1, iterations=1)
            benchmark.extra_info.update(measured, peak_memory_bytes=None)
            _check_extra_info(benchmark.extra_info)
            return benchmark.extra_info
        flops = count_flops(fn)
        with peak_memory() as mem:
            fn()
        benchmark.pedantic(fn, rounds=rounds, warmup_rounds=1, iterations=1)
        median = benchmark.stats.stats.median
        benchmark.extra_info.update(
            flops=flops, flops_per_second=flops / median,
            tokens_per_second=batch * length / median, peak_memory_bytes=mem["peak_bytes"],
        )
        _check_extra_info(benchmark.extra_info)
        return benchmark.extra_info

    return run
