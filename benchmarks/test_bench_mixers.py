"""Every registered mixer x sequence length x batch, forward and forward+backward (dim 128).

The lengths are modest so that the O(L^2) materializing mixers (Vandermonde, Cauchy) keep the CI smoke run
short; `benchmarks/test_bench_scaling.py` and `mixer-plugins bench --lengths ...` go long.
"""

from __future__ import annotations

import pytest

import mixer_plugins as mp

LENGTHS = [128, 512]
BATCHES = [1, 4]


@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("mixer", mp.list_mixers())
def test_mixer(mixer_benchmark, mixer, length, batch, mode):
    mixer_benchmark(mixer, dim=128, length=length, batch=batch, mode=mode)
