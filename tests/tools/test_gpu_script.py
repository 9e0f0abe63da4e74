"""The GPU check script cannot rot: CI runs it in its dry mode (CPU, Triton interpreter, tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_script_dry_run_writes_its_tables(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), str(tmp_path), "--dry"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "throughput.json").read_text())
    rows = data["rows"]
    assert [t for t in dict.fromkeys(r["table"] for r in rows)] == ["vit", "launches", "parts", "scan"]
    # what can run on the CPU did run; what cannot (mamba-ssm here) says why
    measured = {r["candidate"] for r in rows if r["ms"] is not None}
    assert {"QS fused (ours, triton)", "QS chunked (ours, torch)", "SDPA attention", "ViT-B/16 attention",
            "ViT-B/16 quasi", "ViT-B/16 quasi (torch.compile)", "quasi", "attention", "Hydra: scan",
            "Hydra: short conv + SiLU", "Hydra: gated norm", "Hydra: projections", "Hydra: whole mixer",
            "Hydra: glue (whole minus the parts)", "attention: SDPA"} <= measured
    assert {"causal SSD (mamba-ssm) chunk 64", "causal SSD (mamba-ssm) chunk 256",
            "released Hydra (mamba-ssm, one call, doubled batch) chunk 64",
            "released Hydra (mamba-ssm, one call, doubled batch) chunk 256"} <= {r["candidate"] for r in rows}
    assert all(r["ms"] is not None or r["note"] for r in rows)
    launches = {r["candidate"]: r["ms"] for r in rows if r["table"] == "launches"}
    assert 0 < launches["quasi"] <= 40
    assert any(t["target"].startswith("launches per Hydra mixer") for t in data["targets"])
    text = (tmp_path / "throughput.md").read_text()
    assert "| candidate | L | batch | mode | ms | peak MiB | note |" in text
    assert data["environment"]["torch"]
    assert (tmp_path / "normconv_rows.json").exists() and (tmp_path / "kernel_tests.xml").exists()
    log = (tmp_path / "log.txt").read_text()
    assert "== kernel tests" in log and "== tables" in log and "== done (status 0)" in log


def test_the_tables_are_written_after_every_row(tmp_path):
    """A run stopped from outside keeps what it measured: ``throughput.json`` is rewritten after each row."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / "benchmarks" / "gpu")!r})
import throughput
sizes = []
original = throughput.write
def write(out, info, rows):
    sizes.append(len(rows))
    return original(out, info, rows)
throughput.write = write
throughput.main(["--out", {str(tmp_path)!r}, "--dry", "--tables", "launches"])
print("sizes", sizes)
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sizes = [int(n) for n in result.stdout.split("sizes [")[1].split("]")[0].split(",")]
    assert sizes[:3] == [0, 1, 2]    # before any row, then after each of the two launch rows
