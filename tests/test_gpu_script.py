"""The GPU check script cannot rot: CI runs it in its dry mode (CPU, Triton interpreter, tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_dry_run_writes_its_tables(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), str(tmp_path), "--dry"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "throughput.json").read_text())
    rows = data["rows"]
    assert {r["table"] for r in rows} == {"scan", "attention", "vit"}
    # what can run on the CPU did run; what cannot says why
    measured = {r["candidate"] for r in rows if r["ms"] is not None}
    assert {"QS chunked (ours, torch)", "SDPA attention", "mlr_attention", "attention"} <= measured
    assert all(r["ms"] is not None or r["note"] for r in rows)
    text = (tmp_path / "throughput.md").read_text()
    assert "| candidate | L | batch | mode | ms | peak MiB | note |" in text
    assert data["environment"]["torch"]
