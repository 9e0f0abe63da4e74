"""CPU speed targets of the SSM mixers against SDPA attention, asserted only when benchmarking is enabled:

* attention / mixer forward+backward time >= 10x at L = 16384 and >= 0.8x at L = 1024 (dim 256, batch 1),
  for quasiseparable and semiseparable, the ratio taken per interleaved round (median over the rounds);
* a timm ViT-S/16 training step (batch 32, 197 tokens) with ``mixer='quasi'`` takes at most 1.5x the attention
  model's time, in the steady state of training (after :data:`speed_ratios.VIT_WARMUP` steps of each model).

With ``--benchmark-disable`` (CI) each test makes one cheap call of the same code on tiny shapes, so it cannot rot.
The same figures, outside pytest: ``python benchmarks/speed_ratios.py``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_ratios import REFERENCE, VIT_WARMUP, step, vit_step  # noqa: E402

from mixer_plugins.tools.benchmarking import time_calls  # noqa: E402

MIXERS = ["quasiseparable", "semiseparable"]
TARGETS = {1024: 0.8, 16384: 10.0}  # attention time / mixer time, at least
VIT_TARGET = 1.5                   # quasi ViT-S step time / attention ViT-S step time, at most


def _record(benchmark, **info) -> None:
    benchmark.extra_info.update(info)
    benchmark.pedantic(lambda: None, rounds=1)


@pytest.mark.parametrize("length", sorted(TARGETS))
@pytest.mark.parametrize("mixer", MIXERS)
def test_target_ratio_vs_attention(benchmark, benchmarking_enabled, mixer, length):
    if not benchmarking_enabled:  # CI: the same code, once, on a tiny sequence (one case is enough)
        if (mixer, length) != (MIXERS[0], min(TARGETS)):
            pytest.skip("timing target: runs with benchmarking enabled (one case smoke-tests the code)")
        fns = {n: step(n, 32, dim=32) for n in (mixer, REFERENCE)}
        times = benchmark.pedantic(lambda: time_calls(fns, rounds=1, warmup=0), rounds=1, iterations=1)
        assert times.ratio(REFERENCE, mixer)["median"] > 0
        assert {n: len(f) for n, f in times.faults.items()} == {mixer: 1, REFERENCE: 1}
        assert all(f[0] >= 0 for f in times.faults.values())
        return
    rounds = 3 if length >= 16384 else 7
    times = time_calls({n: step(n, length) for n in (mixer, REFERENCE)}, rounds=rounds)
    ratio = times.ratio(REFERENCE, mixer)
    page_faults = {n: statistics.median(f) for n, f in times.faults.items()}
    _record(benchmark, mixer=mixer, length=length, ratio=ratio, threads=torch.get_num_threads(),
            seconds={n: times.median(n) for n in times.seconds}, page_faults=page_faults)
    print(f"\nL={length} fwd+bwd attention/{mixer}: {ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]"
          f"; page faults per call {page_faults}")
    assert ratio["median"] >= TARGETS[length], (
        f"attention/{mixer} forward+backward time ratio at L={length} is {ratio['median']:.2f} "
        f"[{ratio['min']:.2f}, {ratio['max']:.2f}] (target >= {TARGETS[length]}), with {page_faults[mixer]:.0f} "
        "page faults per call (see docs/performance.md on the allocator)")


def test_target_vit_small_training_step(benchmark, benchmarking_enabled):
    pytest.importorskip("timm")
    if not benchmarking_enabled:  # CI: one step of a two-block ViT-S on 2 x 32 x 32 images
        benchmark.pedantic(vit_step("quasi", batch=2, img_size=32, depth=2), rounds=1, iterations=1)
        return
    times = time_calls({"quasi": vit_step("quasi", batch=32), REFERENCE: vit_step("attention", batch=32)},
                       rounds=3, warmup=VIT_WARMUP)  # steady state: see VIT_WARMUP
    ratio = times.ratio("quasi", REFERENCE)  # quasi time / attention time
    _record(benchmark, ratio=ratio, seconds={n: times.median(n) for n in times.seconds},
            threads=torch.get_num_threads())
    print(f"\nViT-S/16 training step, batch 32: quasi/attention time {ratio['median']:.2f} "
          f"[{ratio['min']:.2f}, {ratio['max']:.2f}]")
    assert ratio["median"] <= VIT_TARGET, (
        f"a ViT-S/16 training step with mixer='quasi' takes {ratio['median']:.2f}x the attention model's time "
        f"(target <= {VIT_TARGET}x)")
