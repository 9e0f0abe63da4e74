"""Peak memory is reported as a normal process sees it, with malloc untouched."""

from __future__ import annotations

import sys

import pytest
import torch

from mixer_plugins.tools import benchmarking

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU peak memory is measured on Linux")


class _SpyLibc:
    """Stands for libc: records mallopt calls and forwards the rest to the real one."""

    def __init__(self, real):
        self.real, self.mallopt_calls = real, []

    def mallopt(self, param, value):
        self.mallopt_calls.append((param, value))
        return self.real.mallopt(param, value)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _spy_on_libc(monkeypatch) -> _SpyLibc:
    """Route the benchmarking module's glibc calls through a spy (skips without glibc)."""
    real = benchmarking._libc()
    if not real:
        pytest.skip("no glibc")
    spy = _SpyLibc(real)
    monkeypatch.setattr(benchmarking, "_libc", lambda: spy)
    return spy


@linux_only
def test_default_peak_memory_leaves_malloc_untuned(monkeypatch):
    spy = _spy_on_libc(monkeypatch)
    with benchmarking.peak_memory() as mem:
        # 64 MiB, touched: above glibc's largest dynamic mmap threshold (32 MiB), so always fresh pages; 16 MiB could
        # come from heap pages an earlier test left resident (the threshold rises after large frees): a 4 KiB "peak"
        torch.ones(16 << 20)
    assert spy.mallopt_calls == []
    assert mem["peak_bytes"] is not None and mem["peak_bytes"] >= 60 << 20
    benchmarking.measure("attention", dim=16, length=32, repeats=1, warmup=0, options={"num_heads": 2})
    assert spy.mallopt_calls == []  # the bench's own measurements too


@linux_only
def test_tuned_peak_memory_is_only_on_request(monkeypatch):
    spy = _spy_on_libc(monkeypatch)
    with benchmarking.peak_memory(tuned=True) as mem:
        torch.ones(1 << 20)
    assert any(p == benchmarking._M_MMAP_THRESHOLD for p, _ in spy.mallopt_calls)
    assert mem["peak_bytes"] is not None
