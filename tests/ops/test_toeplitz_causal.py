"""The causal Toeplitz product: exact against the matrix, the past bitwise blind to the future (huge
finite values included), gradients exact, batch 0, and FLOP formulas that count what runs."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import mixer_plugins as mp
from mixer_plugins.kernels import toeplitz_causal_flops, toeplitz_mix
from mixer_plugins.kernels.toeplitz.causal import CAUSAL_TILE, causal_toeplitz
from mixer_plugins.tools.benchmarking import build_mixer
from mixer_plugins.tools.flop_report import TOLERANCE, compare_flops

# lengths around the tile (64) and with several FFT levels (600: levels P = 64, 128, 256)
LENGTHS = (1, 7, 64, 65, 200, 600)


def _taps_and_values(length, tap_batch, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    taps = torch.randn(tap_batch, 3, 2 * length - 1, generator=gen, dtype=dtype)
    v = torch.randn(2, length, 3, 4, generator=gen, dtype=dtype)
    return taps, v


def _causal_oracle(taps, v):
    """Independent oracle: the explicit double loop over j <= i, in float64."""
    length = v.shape[1]
    y = torch.zeros(v.shape, dtype=torch.float64)
    t = taps.double().expand(v.shape[0], -1, -1)
    for i in range(length):
        for j in range(i + 1):
            y[:, i] += t[:, :, i - j + length - 1, None] * v[:, j].double()
    return y


@pytest.mark.parametrize("tap_batch", [1, 2])
@pytest.mark.parametrize("length", LENGTHS)
def test_causal_product_and_gradients_are_exact(length, tap_batch):
    taps, v = _taps_and_values(length, tap_batch, torch.float64)
    taps[..., : length - 1] = float("nan")  # the negative offsets must never be read
    y = {}
    grads = {}
    for backend in ("torch", "reference"):
        t = taps.clone().requires_grad_(True)
        w = v.clone().requires_grad_(True)
        y[backend] = toeplitz_mix(t, w, causal=True, backend=backend) if backend == "torch" else \
            toeplitz_mix(torch.cat([torch.zeros_like(t[..., : length - 1]), t[..., length - 1:]], -1), w,
                         causal=True, backend=backend)
        g = torch.linspace(-1, 1, y[backend].numel(), dtype=torch.float64).reshape(y[backend].shape)
        grads[backend] = torch.autograd.grad(y[backend], (t, w), g)
    if length <= 40:
        torch.testing.assert_close(y["torch"], _causal_oracle(taps.nan_to_num(0.0), v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y["torch"], y["reference"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads["torch"][1], grads["reference"][1], rtol=1e-10, atol=1e-10)
    # taps: the gradient of the offsets used (0 .. L-1) is exact; the ignored negative ones get none that matters
    torch.testing.assert_close(grads["torch"][0][..., length - 1:], grads["reference"][0][..., length - 1:],
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("length", [65, 200, 600])
def test_huge_future_leaves_the_past_bitwise_unchanged(length):
    taps, v = _taps_and_values(length, 2, torch.float32)
    y = toeplitz_mix(taps, v, causal=True)
    for pos in sorted({p for p in (1, CAUSAL_TILE, 2 * CAUSAL_TILE + 3, length // 2, length - 1) if p < length}):
        bad_taps, bad_v = taps.clone(), v.clone()
        bad_taps[..., length - 1 + pos] = 1e30   # data-dependent taps: token pos makes offset pos
        bad_v[:, pos] = -1e30
        y_bad = toeplitz_mix(bad_taps, bad_v, causal=True)
        assert torch.equal(y_bad[:, :pos], y[:, :pos]), pos


@pytest.mark.parametrize("options", [{}, {"data_dependent": False, "max_seq_len": 600}])
def test_mixer_past_unchanged_by_a_huge_future_token_over_several_levels(options):
    torch.manual_seed(0)
    mixer = mp.create_mixer("toeplitz", 32, head_dim=16, causal=True, **options).eval()
    x = torch.randn(2, 600, 32)
    bad = x.clone()
    bad[:, 150] = 1e30
    with torch.no_grad():
        y, y_bad = mixer(x), mixer(bad)
        torch.testing.assert_close(y, mixer.forward_via_matrix(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y_bad[:, :150], y[:, :150], rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_batch_zero_kernel(backend, causal):
    taps, v = _taps_and_values(5, 1, torch.float32)
    out = toeplitz_mix(taps, v[:0], causal=causal, backend=backend)
    assert out.shape == (0, 5, 3, 4)


class _FftTally(TorchDispatchMode):
    """Counts what the FFT part of the causal product executes, by the formula's convention: 2.5 n log2 n per
    real transform of size n, 6 per complex multiply, 2 per complex add."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "_fft_r2c":
            n = args[0].shape[-1]
            self.flops += args[0].numel() // n * int(2.5 * n * math.log2(n))
        elif name == "_fft_c2r":
            n = args[3]
            self.flops += args[0].numel() // args[0].shape[-1] * int(2.5 * n * math.log2(n))
        elif name in ("mul", "mul_", "add", "add_") and isinstance(out, torch.Tensor) and out.is_complex():
            self.flops += (6 if name.startswith("mul") else 2) * out.numel()
        return out


@pytest.mark.parametrize("tap_batch", [1, 2])
@pytest.mark.parametrize("length", [7, 100, 600, 1000])
def test_causal_flop_formula_counts_what_runs(length, tap_batch):
    taps, v = _taps_and_values(length, tap_batch, torch.float32)
    c = taps[..., length - 1:]
    with FlopCounterMode(display=False) as counter:
        causal_toeplitz(c, v)
    with _FftTally() as tally:
        causal_toeplitz(c, v)
    assert counter.get_total_flops() + tally.flops == toeplitz_causal_flops(2, length, 3, 4, tap_batch)
    # and through the custom op, as the FLOP counter sees a model
    with FlopCounterMode(display=False) as counter:
        toeplitz_mix(taps, v, causal=True)
    assert counter.get_total_flops() == toeplitz_causal_flops(2, length, 3, 4, tap_batch)


@pytest.mark.parametrize("options", [{"head_dim": 16}, {"head_dim": 16, "data_dependent": False}])
@pytest.mark.parametrize("length", [64, 600])
def test_causal_mixer_flops_agree_with_the_counter(options, length):
    result = compare_flops("toeplitz", dim=32, length=length, batch=2, options={**options, "causal": True},
                           backward=False)
    assert any("toeplitz_causal" in op for op in result.counted_by_op), result.counted_by_op
    assert result.analytic_total == build_mixer("toeplitz", 32, length, options={**options, "causal": True}).flops(
        2, length)
    assert abs(result.counted_forward / result.analytic_counted_part - 1) <= TOLERANCE
