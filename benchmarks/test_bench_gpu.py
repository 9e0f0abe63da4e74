"""The GPU targets of the fused kernels, asserted only on a CUDA device with benchmarking enabled.

* fused quasiseparable forward+backward >= 1.5x faster than quasiseparable through mamba-ssm's kernels run twice,
  and >= 0.85x the throughput of causal Mamba-2 SSD at the same shape;
* fused quasiseparable forward+backward >= 5x faster than SDPA attention at L = 16k;
* MLR attention (Triton) forward+backward: its time ratio to SDPA attention within 1.2x of its FLOP ratio at
  L = 4k and 16k (paper rank list).
The measurements are those of ``benchmarks/gpu/throughput.py`` (d_model 768, head dim 64, state 64, bf16, 65,536
tokens per batch).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("gpu_throughput", Path(__file__).parent / "gpu" / "throughput.py")
throughput = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = throughput
_spec.loader.exec_module(throughput)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU targets: needs a CUDA device")


def _check(benchmark, benchmarking_enabled, rows_of, keep, why_none: str) -> None:
    """Measure the rows, record the targets computed from them (``keep`` selects which), assert every one held."""
    if not benchmarking_enabled:
        pytest.skip("timing targets: run with benchmarking enabled")
    rows = rows_of(throughput.Setup(device="cuda", dtype=torch.bfloat16, lengths=(4096, 16384)))
    checks = [c for c in throughput.targets(rows) if keep(c)]
    benchmark.extra_info["targets"] = checks
    benchmark.pedantic(lambda: None, rounds=1)
    if not checks:
        pytest.skip(why_none + ": " + "; ".join(f"{r.candidate}: {r.note}" for r in rows if r.ms is None))
    failed = [c for c in checks if not c["held"]]
    assert not failed, failed


@pytest.mark.gpu
@needs_cuda
def test_fused_scan_targets(benchmark, benchmarking_enabled):
    _check(benchmark, benchmarking_enabled, throughput.scan_rows, lambda c: not c["target"].startswith("MLR"),
           "the fused Triton backend or mamba-ssm cannot run here")


@pytest.mark.gpu
@needs_cuda
def test_mlr_attention_target(benchmark, benchmarking_enabled):
    _check(benchmark, benchmarking_enabled, throughput.attention_rows, lambda c: c["target"].startswith("MLR"),
           "mlr_attention or attention could not run here")
