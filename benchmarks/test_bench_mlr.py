"""MLR attention through the tiled op (``mixer_plugins.kernels.mlr_attention``) against softmax attention (SDPA),
dim 256, 4 heads of 64 (the paper's head size), the paper's rank list ``32|8|6|4|4|4|4|2`` with the mixer's default
blocks (global, then 512 ... 8), causal, on CPU. Targets (issue 14, item 4):

* time follows FLOPs: at L=4096, forward+backward time ratio (mlr / attention) <= 1.2 x their total-FLOP ratio;
* peak memory linear in L: forward+backward peak within 1.3x of linear from 2048 to 8192 tokens.

The targets are measured only when benchmarking is enabled (``make bench``), never in timed unit tests.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from mixer_plugins.kernels.mlr_attention import mlr_attention
from mixer_plugins.tools.benchmarking import build_mixer, peak_memory

DIM, HEADS = 256, 4
RANKS = [32, 8, 6, 4, 4, 4, 4, 2]


def _mlr_mixer(length: int, causal: bool = True):
    return build_mixer("mlr_attention", DIM, length, causal=causal, options={"num_heads": HEADS, "ranks": RANKS})


def _mlr_via_op(mixer, x: torch.Tensor) -> torch.Tensor:
    """The mixer's forward with ``mix`` replaced by the op (what the mixer does once it calls the op)."""
    ctx = mixer.prepare(x, None)
    y = mlr_attention(ctx.q, ctx.k, ctx.values, ranks=mixer.ranks, block_sizes=mixer.block_sizes,
                      scales=mixer.level_scales, causal=mixer.causal, mask=ctx.mask, block_divide=mixer.block_divide)
    return mixer.finish(ctx, y)


def _steps(length: int, causal: bool = True, seed: int = 0):
    """forward+backward closures of mlr (via the op) and attention (SDPA), and their analytic FLOPs."""
    torch.manual_seed(seed)
    mlr = _mlr_mixer(length, causal).train()
    attn = build_mixer("attention", DIM, length, causal=causal, options={"num_heads": HEADS}).train()
    x = torch.randn(1, length, DIM, requires_grad=True)

    def run_mlr() -> None:
        x.grad = None
        _mlr_via_op(mlr, x).sum().backward()

    def run_attn() -> None:
        x.grad = None
        attn(x).sum().backward()

    return run_mlr, run_attn, mlr.flops(1, length), attn.flops(1, length)


@pytest.mark.parametrize("length", [1024, 4096])
@pytest.mark.parametrize("which", ["mlr_op", "attention"])
def test_forward_backward(benchmark, which, length):
    run_mlr, run_attn, mlr_flops, attn_flops = _steps(length)
    benchmark.group = f"mlr vs attention fwd+bwd L={length} D={DIM} H={HEADS}"
    benchmark.extra_info.update(length=length, analytic_flops=3 * (mlr_flops if which == "mlr_op" else attn_flops))
    benchmark.pedantic(run_mlr if which == "mlr_op" else run_attn, rounds=1 if length >= 4096 else 3,
                       warmup_rounds=0)


def _interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def test_target_time_follows_flops(benchmark, benchmarking_enabled):
    if not benchmarking_enabled:
        pytest.skip("timing target: runs with benchmarking enabled")
    run_mlr, run_attn, mlr_flops, attn_flops = _steps(4096)
    mixer = _mlr_mixer(4096).train()
    x = torch.randn(1, 4096, DIM, requires_grad=True)

    def run_mixer() -> None:  # the mixer's own blocked mix (dense L x L softmax), for the record
        mixer(x).sum().backward()

    times = _interleaved({"mlr": run_mlr, "attention": run_attn, "mlr_mixer": run_mixer}, repeats=3)
    ratios = [m / a for m, a in zip(times["mlr"], times["attention"])]
    time_ratio = statistics.median(ratios)
    flop_ratio = mlr_flops / attn_flops
    mixer_ratios = [m / a for m, a in zip(times["mlr_mixer"], times["attention"])]
    benchmark.extra_info.update(mlr_seconds=times["mlr"], attention_seconds=times["attention"],
                                mlr_mixer_seconds=times["mlr_mixer"], time_ratios=ratios,
                                mixer_time_ratios=mixer_ratios, flop_ratio=flop_ratio)
    benchmark.pedantic(lambda: None, rounds=1)
    print(f"\nL=4096 fwd+bwd: mlr {times['mlr']} s, attention {times['attention']} s; time ratio "
          f"{time_ratio:.2f} (range {min(ratios):.2f}-{max(ratios):.2f}), FLOP ratio {flop_ratio:.2f}; the mixer's "
          f"own mix {times['mlr_mixer']} s (ratio {min(mixer_ratios):.2f}-{max(mixer_ratios):.2f})")
    assert time_ratio <= 1.2 * flop_ratio, (
        f"mlr/attention time ratio {time_ratio:.2f} > 1.2 x FLOP ratio {flop_ratio:.2f} at L=4096")


def test_target_linear_memory(benchmark, benchmarking_enabled):
    if not benchmarking_enabled:
        pytest.skip("memory target: runs with benchmarking enabled")
    peaks = {}
    for length in (2048, 8192):
        run_mlr, _, _, _ = _steps(length)
        run_mlr()  # warm-up: allocator and lazy state outside the measured block
        with peak_memory("cpu") as mem:
            run_mlr()
        peaks[length] = mem["peak_bytes"]
    if peaks[2048] is None:
        pytest.skip("peak memory cannot be measured here")
    growth = peaks[8192] / peaks[2048]
    benchmark.extra_info.update(peak_2048=peaks[2048], peak_8192=peaks[8192], growth=growth)
    benchmark.pedantic(lambda: None, rounds=1)
    print(f"\nmlr fwd+bwd peak memory: 2048 -> {peaks[2048] / 2**20:.0f} MiB, 8192 -> {peaks[8192] / 2**20:.0f} MiB "
          f"({growth:.2f}x for 4x the length)")
    assert growth <= 4 * 1.3, f"peak memory grew {growth:.2f}x for 4x the length (target <= 5.2x)"
