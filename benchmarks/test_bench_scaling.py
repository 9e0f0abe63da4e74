"""Scaling in the sequence length: quasiseparable (Hydra) and semiseparable (Mamba-2 SSD) against softmax
attention, dim 256, L up to 16384, on CPU; targets:

* quasiseparable forward+backward at L=16384 at least 5x faster than attention;
* quasiseparable peak memory growing linearly in L: within 1.3x of linear from 4096 to 16384.

The targets are measured only when benchmarking is enabled (``make bench``), never in timed unit tests.
"""

from __future__ import annotations

import pytest

from mixer_plugins.tools.benchmarking import measure

MIXERS = ["quasiseparable", "semiseparable", "attention"]
LENGTHS = [256, 1024, 4096, 16384]


@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("mixer", MIXERS)
def test_scaling(mixer_benchmark, mixer, length, mode):
    if length == 16384 and mixer == "attention" and mode == "forward_backward":
        pytest.skip("measured once, by test_target_speed_vs_attention")
    mixer_benchmark(mixer, dim=256, length=length, batch=1, mode=mode, rounds=1 if length >= 4096 else 3)


def test_target_speed_vs_attention(benchmark, benchmarking_enabled):
    if not benchmarking_enabled:
        pytest.skip("timing target: runs with benchmarking enabled")
    quasi = measure("quasiseparable", dim=256, length=16384, mode="forward_backward", repeats=1, memory=False)
    attn = measure("attention", dim=256, length=16384, mode="forward_backward", repeats=1, memory=False)
    ratio = attn.seconds / quasi.seconds
    benchmark.extra_info.update(quasi_seconds=quasi.seconds, attention_seconds=attn.seconds, speedup=ratio)
    benchmark.pedantic(lambda: None, rounds=1)
    print(f"\nL=16384 fwd+bwd: quasiseparable {quasi.seconds:.2f}s, attention {attn.seconds:.2f}s, ratio {ratio:.1f}x")
    assert ratio >= 5.0, f"quasiseparable is only {ratio:.1f}x faster than attention at L=16384 (target 5x)"


def test_target_linear_memory(benchmark, benchmarking_enabled):
    if not benchmarking_enabled:
        pytest.skip("memory target: runs with benchmarking enabled")
    peaks = {L: measure("quasiseparable", dim=256, length=L, mode="forward_backward", repeats=1, warmup=1)
             .peak_memory_bytes for L in (4096, 16384)}
    growth = peaks[16384] / peaks[4096]
    benchmark.extra_info.update(peak_4096=peaks[4096], peak_16384=peaks[16384], growth=growth)
    benchmark.pedantic(lambda: None, rounds=1)
    print(f"\nquasiseparable fwd+bwd peak memory: 4096 -> {peaks[4096] / 2**20:.0f} MiB, "
          f"16384 -> {peaks[16384] / 2**20:.0f} MiB ({growth:.2f}x for 4x the length)")
    assert growth <= 4 * 1.3, f"peak memory grew {growth:.2f}x for 4x the length (target <= 5.2x)"
