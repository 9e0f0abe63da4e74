"""MLR attention vs standard attention, forward + backward, at L in {1024, 4096} with the paper's 8-level rank list.

Run: ``pytest benchmarks/test_bench_structured_attention.py --benchmark-only`` (CI runs it with
``--benchmark-disable``: one round each, as a smoke test). Each benchmark's ``extra_info`` holds the measured mean time,
the analytic score-FLOP and total-FLOP ratios of MLR to attention, and (for MLR, once the attention run at the same
length has been timed in the same run) the measured time ratio, side by side.

Setup: dim 256, 4 heads of 64, batch 1, ranks 32|8|6|4|4|4|4|2 (sum 64) with the paper's halving blocks
(level 0 global, then L/2, L/4, ..., L/128), block-divide on. Attention uses PyTorch's fused SDPA kernel; MLR runs
on its default backend (on CPU the native engine: flash-style tiles, the softmax over all keys).
"""

from __future__ import annotations

import pytest
import torch

import mixer_plugins as mp

DIM, HEADS, BATCH = 256, 4, 1
RANKS = [32, 8, 6, 4, 4, 4, 4, 2]
_MEAN_TIME: dict[tuple[str, int], float] = {}  # (mixer, length) -> measured mean seconds, this run


def build(name: str, length: int):
    if name == "attention":
        return mp.create_mixer("attention", DIM, num_heads=HEADS)
    blocks = [None] + [length // 2**level for level in range(1, len(RANKS))]
    return mp.create_mixer("mlr_attention", DIM, num_heads=HEADS, ranks=RANKS, block_sizes=blocks)


@pytest.mark.parametrize("length", [1024, 4096])
@pytest.mark.parametrize("name", ["attention", "mlr_attention"])  # attention first: MLR's time ratio needs it
def test_forward_backward(benchmark, name, length):
    torch.manual_seed(0)
    mixer = build(name, length)
    baseline = build("attention", length)
    x = torch.randn(BATCH, length, DIM, requires_grad=True)

    def step():
        mixer.zero_grad(set_to_none=True)
        x.grad = None
        mixer(x).sum().backward()

    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)
    assert x.grad is not None and torch.isfinite(x.grad).all()

    parts, base = mixer.flops_breakdown(BATCH, length), baseline.flops_breakdown(BATCH, length)
    info = benchmark.extra_info
    info.update(mixer=name, length=length, dim=DIM, heads=HEADS, ranks="|".join(map(str, RANKS)),
                score_flops=parts["scores"], total_forward_flops=mixer.flops(BATCH, length),
                score_flop_ratio_vs_attention=round(parts["scores"] / base["scores"], 4),
                total_flop_ratio_vs_attention=round(mixer.flops(BATCH, length) / baseline.flops(BATCH, length), 4))
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None when run with --benchmark-disable
        mean = stats.stats.mean
        _MEAN_TIME[(name, length)] = mean
        info["measured_mean_s"] = round(mean, 4)
        if name != "attention" and ("attention", length) in _MEAN_TIME:
            info["time_ratio_vs_attention"] = round(mean / _MEAN_TIME[("attention", length)], 3)
