"""``toeplitz_mix`` (the long convolution by FFT) against its definition, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import F64
from torch.utils.flop_counter import FlopCounterMode

import mixer_plugins as mp
from mixer_plugins import kernels

# -- toeplitz ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [1, 2, 7, 16, 33])
def test_toeplitz_fft_matches_the_definition(length):
    taps = torch.randn(2, 3, 2 * length - 1, dtype=F64)
    v = torch.randn(2, length, 3, 4, dtype=F64)
    y = kernels.toeplitz_mix(taps, v)
    expected = torch.zeros_like(v)
    for i in range(length):
        for j in range(length):
            expected[:, i] += taps[:, :, i - j + length - 1][..., None] * v[:, j]
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kernels.toeplitz_mix(taps, v, backend="reference"), expected)


@pytest.mark.parametrize("tap_batch", [1, 2])
def test_toeplitz_gradients(tap_batch):
    taps = torch.randn(tap_batch, 2, 9, dtype=F64, requires_grad=True)
    v = torch.randn(2, 5, 2, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, u: kernels.toeplitz_mix(t, u), (taps, v))


def test_toeplitz_rejects_mismatched_taps():
    with pytest.raises(mp.MixerInputError, match="2\\*length-1"):
        kernels.toeplitz_mix(torch.randn(1, 2, 8), torch.randn(1, 5, 2, 3))


def test_fft_size_covers_the_linear_convolution():
    from mixer_plugins.kernels.toeplitz.torch import _fft_size

    for length in (1, 2, 3, 100, 1000):
        n = _fft_size(length)
        assert n >= 2 * length - 1 and n & (n - 1) == 0 and n < 4 * length
        assert math.log2(n).is_integer()


def test_flop_counter_sees_the_fft():
    taps = torch.randn(1, 4, 59)
    with FlopCounterMode(display=False) as counter:
        kernels.toeplitz_mix(taps, torch.randn(2, 30, 4, 3))
    assert counter.get_total_flops() > 0
