"""Decoding: time per generated token against the number of tokens already in the cache, for the linear-time
mixers that step (semiseparable, low_rank, sliding-window attention) and attention with its KV cache; dim 256,
batch 1, on CPU. Targets:

* semiseparable per-token time at 8,192 tokens of context within 1.2x of its time at 128 (constant work per token);
* attention's per-token time grows with the context (its KV cache);
* semiseparable at least 3x faster per token than attention at 8,192 tokens of context.

The targets are measured only when benchmarking is enabled (``make bench``), with the mixers interleaved token by
token in one process (``mixer-plugins bench --decode`` runs the same measurement); in CI each case runs once.
"""

from __future__ import annotations

import pytest
import torch

from mixer_plugins.tools.benchmarking import build_mixer
from mixer_plugins.tools.cli.bench import decode_table, time_decoding

MIXERS = ["semiseparable", "low_rank", "sliding_window_attention", "attention"]
CONTEXTS = [128, 1024, 8192]
DIM = 256
ROUNDS, WARMUP = 20, 3


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("mixer", MIXERS)
def test_decode_step(benchmark, benchmarking_enabled, mixer, context):
    """One generated token (a step of one token) after ``context`` tokens of prefill."""
    torch.manual_seed(0)
    capacity = context + ROUNDS + WARMUP + 1
    model = build_mixer(mixer, DIM, capacity, causal=True).eval()
    cache = model.allocate_cache(1, capacity)
    x = torch.randn(1, 1, DIM)
    with torch.no_grad():
        model.prefill(torch.randn(1, context, DIM), cache)
    benchmark.group = f"decode D={DIM} B=1 L={context}"
    benchmark.extra_info.update(mixer=mixer, context=context, dim=DIM, batch=1)

    def step():
        with torch.no_grad():
            return model.step(x, cache)

    if benchmarking_enabled:
        y = benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=WARMUP)
    else:
        y = benchmark(step)
    assert y.shape == (1, 1, DIM) and torch.isfinite(y).all()


def test_decode_targets(benchmark, benchmarking_enabled):
    if not benchmarking_enabled:
        pytest.skip("timing targets: run with benchmarking enabled")
    timings, problems = time_decoding(MIXERS, [128, 8192], dim=DIM, batch=1, steps=64, warmup=8)
    assert not problems, problems
    median = {(t.mixer, t.context): t.median for t in timings}
    print("\n" + decode_table(timings, baseline="attention", markdown=True))
    flat = median["semiseparable", 8192] / median["semiseparable", 128]
    growth = median["attention", 8192] / median["attention", 128]
    speedup = median["attention", 8192] / median["semiseparable", 8192]
    benchmark.extra_info.update(semiseparable_growth=flat, attention_growth=growth, speedup_at_8192=speedup)
    benchmark.pedantic(lambda: None, rounds=1)
    assert flat <= 1.2, f"semiseparable per-token time grew {flat:.2f}x from 128 to 8192 tokens (target <= 1.2x)"
    assert growth > 2.0, f"attention's per-token time grew only {growth:.2f}x from 128 to 8192 tokens"
    assert speedup >= 3.0, f"semiseparable is only {speedup:.2f}x faster than attention at 8192 (target 3x)"
