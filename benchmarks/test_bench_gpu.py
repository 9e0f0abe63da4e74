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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU targets: needs a CUDA device")
def test_fused_scan_targets(benchmark, benchmarking_enabled):
    if not benchmarking_enabled:
        pytest.skip("timing targets: run with benchmarking enabled")
    setup = throughput.Setup(device="cuda", dtype=torch.bfloat16, lengths=(4096, 16384))
    rows = throughput.scan_rows(setup)
    checks = throughput.targets(rows)
    benchmark.extra_info["targets"] = checks
    benchmark.pedantic(lambda: None, rounds=1)
    if not checks:
        pytest.skip("the fused Triton backend or mamba-ssm cannot run here: " +
                    "; ".join(f"{r.candidate}: {r.note}" for r in rows if r.ms is None))
    failed = [c for c in checks if not c["held"]]
    assert not failed, failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU targets: needs a CUDA device")
def test_mlr_attention_target(benchmark, benchmarking_enabled):
    if not benchmarking_enabled:
        pytest.skip("timing targets: run with benchmarking enabled")
    setup = throughput.Setup(device="cuda", dtype=torch.bfloat16, lengths=(4096, 16384))
    rows = throughput.attention_rows(setup)
    checks = [c for c in throughput.targets(rows) if c["target"].startswith("MLR")]
    benchmark.extra_info["targets"] = checks
    benchmark.pedantic(lambda: None, rounds=1)
    if not checks:
        pytest.skip("mlr_attention or attention could not run here: " +
                    "; ".join(f"{r.candidate}: {r.note}" for r in rows if r.ms is None))
    failed = [c for c in checks if not c["held"]]
    assert not failed, failed
