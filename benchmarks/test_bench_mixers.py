"""Every registered mixer x sequence length x batch, forward and forward+backward (dim 128)."""

from __future__ import annotations

import pytest

import mixer_plugins as mp

LENGTHS = [256, 1024]
BATCHES = [1, 4]


@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("mixer", mp.list_mixers())
def test_mixer(mixer_benchmark, mixer, length, batch, mode):
    mixer_benchmark(mixer, dim=128, length=length, batch=batch, mode=mode)
