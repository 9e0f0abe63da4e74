"""The GPU check script cannot rot: CI runs it in its dry mode (CPU, Triton interpreter, tiny shapes), checks that it
runs its steps in priority order and that its summary has a verdict row for every target; the deadlines, the summary
and the import check are checked on their own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))

import deadline  # noqa: E402  (benchmarks/gpu/deadline.py)
import targets  # noqa: E402  (benchmarks/gpu/targets.py)

#: the steps of run.sh, in the priority order of the GPU check (docs/kernels.md, "The GPU check")
STEPS = ["install", "import", "qs16k", "vit", "launches", "mlr", "scan_tests", "normconv_tests", "vit_compiled",
         "mamba", "gpu_tests", "summary", "done"]


def _run_sh(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(GPU / "run.sh"), str(out), *args], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry")
    result = _run_sh(out, "--dry")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


@pytest.mark.slow  # the whole dry run (its fixture): ~1.5 min
def test_the_dry_run_takes_its_steps_in_priority_order(dry_run):
    out, _ = dry_run
    log = (out / "log.txt").read_text()
    steps = re.findall(r"^== (\w+) \(", log, flags=re.M)
    assert steps == STEPS, log[-3000:]
    assert "== done (status 0)" in log
    recorded = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [r[0] for r in recorded] == STEPS[:-2]
    assert all(r[1] == "done" for r in recorded), recorded


def test_the_dry_run_has_a_verdict_row_per_target(dry_run):
    out, result = dry_run
    text = (out / "summary.md").read_text()
    assert text.strip() in result.stdout      # printed at the end
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    for target in targets.TARGETS:
        row = [r for r in rows if r.startswith(f"| {target.text} | {target.bound_text()} |")]
        assert len(row) == 1, (target.key, text)
        assert "| not measured |" in row[0], row[0]     # a dry run measures no target
    summary = json.loads((out / "summary.json").read_text())
    assert [r["key"] for r in summary["targets"]] == [t.key for t in targets.TARGETS]
    assert summary["dry"] and summary["gpu"] == "cpu (dry run)"
    # the dry values are shown as such: every target a dry step measures has its (meaningless) value
    dry = {r["key"] for r in summary["targets"] if r["dry"]}
    assert dry == {t.key for t in targets.TARGETS} - {"no_spills_sm90"}


def test_the_dry_run_writes_every_table(dry_run):
    out, _ = dry_run
    for name in ("environment", "qs16k", "vit", "launches", "mlr_rows", "vit_compiled", "mamba"):
        assert (out / f"{name}.json").exists(), name
    for name in ("scan_tests", "normconv_tests", "gpu_tests"):
        assert (out / f"{name}.xml").exists(), name
    rows = {name: json.loads((out / f"{name}.json").read_text())["rows"]
            for name in ("qs16k", "vit", "launches", "vit_compiled", "mamba")}
    # what can run on the CPU did run; what cannot (mamba-ssm here) says why
    measured = {r["candidate"] for table in rows.values() for r in table if r["ms"] is not None}
    assert {"QS fused (ours, triton)", "SDPA attention", "ViT-B/16 attention (timm)", "ViT-B/16 attention (vit_base)",
            "ViT-B/16 quasi", "ViT-B/16 quasi (torch.compile)", "quasi one chunk fp32",
            "quasi one chunk bf16 autocast", "quasi chunked fp32", "quasi chunked bf16 autocast",
            "attention bf16 autocast"} <= measured
    assert [r["mode"] for r in rows["qs16k"]][:2] == ["forward_backward", "forward_backward"]   # the targets first
    assert {r["candidate"] for r in rows["mamba"]} >= {"causal SSD (mamba-ssm) chunk 16",
                                                      "released Hydra (mamba-ssm, one call, doubled batch) chunk 16"}
    assert all(r["ms"] is not None or r["note"] for table in rows.values() for r in table)
    launches = {r["candidate"]: r["ms"] for r in rows["launches"]}
    assert 0 < launches["quasi one chunk fp32"] <= 40 and 0 < launches["quasi chunked fp32"] <= 40
    mlr = json.loads((out / "mlr_rows.json").read_text())
    assert [r["length"] for r in mlr["rows"]] == [16, 16, 16, 8, 8, 8]   # the long length first
    assert {m["key"] for m in mlr["targets"]} == {"mlr_16k", "window_16k", "mlr_paper_16k", "mlr_4k", "mlr_paper_4k"}
    assert all(c["ok"] for c in mlr["checks"])


def test_the_tables_are_written_after_every_row(tmp_path):
    """A run stopped from outside keeps what it measured: ``NAME.json`` is rewritten after each row."""
    script = f"""
import sys
sys.path.insert(0, {str(GPU)!r})
import throughput
sizes = []
original = throughput.write
def write(out, info, rows, name="throughput"):
    sizes.append(len(rows))
    return original(out, info, rows, name)
throughput.write = write
throughput.main(["--out", {str(tmp_path)!r}, "--dry", "--tables", "vit", "--name", "vit"])
print("sizes", sizes)
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sizes = [int(n) for n in result.stdout.split("sizes [")[1].split("]")[0].split(",")]
    assert sizes[:4] == [0, 1, 2, 3]    # before any row, then after each of the three ViT rows
    assert (tmp_path / "vit.json").exists()


def test_past_the_deadline_the_rows_left_are_not_measured(tmp_path):
    """A step whose deadline has passed measures nothing more: its rows, and its targets, say so."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT),
           deadline.ENV: str(time.time() - 1)}
    result = subprocess.run([sys.executable, str(GPU / "throughput.py"), "--out", str(tmp_path), "--dry",
                             "--tables", "qs16k,launches", "--name", "cut"], env=env, capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == deadline.EXIT_CUT, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "cut.json").read_text())
    assert data["rows"] and all(r["ms"] is None and r["note"] == deadline.NOT_STARTED for r in data["rows"])
    assert data["targets"] and all(m["value"] is None and m["verdict"] == targets.NOT_MEASURED
                                   for m in data["targets"])


def test_a_timing_loop_stops_at_the_deadline():
    """Inside a row: past the deadline the loop stops after one timed call (the warm-up that compiled is kept)."""
    from mixer_plugins.tools.benchmarking import time_calls

    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.06)

    times = time_calls(slow, warmup=2, rounds=5, deadline=time.time() + 0.05)
    assert len(calls) == 2 and len(times.seconds[None]) == 1
    assert times.note.startswith("cut at the deadline: 1 of 5 timed calls, 1 of 2 warm-ups")
    times = time_calls(lambda: None, warmup=1, rounds=3, deadline=deadline.Deadline().at)
    assert len(times.seconds[None]) == 3 and times.note == ""


def test_verdicts():
    vit = targets.BY_KEY["vit_step_timm"]
    assert targets.verdict(vit, 1.5) == ("held", "held")
    assert targets.verdict(vit, 1.8) == ("held", "missed")
    assert targets.verdict(vit, 2.1) == ("missed", "missed")
    assert targets.verdict(vit, None) == ("not measured", "")
    assert targets.verdict(vit, 1.5, dry=True) == ("not measured", "")
    assert targets.BY_KEY["window_16k"].bound_text() == "<= 0.25x"
    assert targets.BY_KEY["qs16k_ms"].bound_text() == "<= 5.5 ms"


def test_the_summary_reads_a_compile_check_and_says_why_a_target_is_missing(tmp_path):
    """No results at all: every target not measured, with the step that should have measured it; the spill target
    from a compile check's JSON file (the float32 scans' spills allowed, any other counted)."""
    (tmp_path / "steps.tsv").write_text("install\tdone\t1\t25\nimport\tdone\t5\t25\nqs16k\tcut at its limit (60 s)"
                                        "\t60\t60\n")
    report = {"arch": 90, "failures": [], "compiled": [
        {"kernel": "_dx_kernel", "case": "scan: float32 x", "stack_bytes": 64, "local_bytes": 0},
        {"kernel": "_mlr_bwd_dq_kernel", "case": "mlr: float32 causal", "stack_bytes": 40, "local_bytes": 0},
        {"kernel": "_norm_fwd_kernel", "case": "norm: bfloat16", "stack_bytes": 0, "local_bytes": 0}]}
    (tmp_path / "compile_check_triton3.6.0.json").write_text(json.dumps(report))
    result = subprocess.run([sys.executable, str(GPU / "summary.py"), "--out", str(tmp_path)], capture_output=True,
                            text=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                         if k != "MIXER_PLUGINS_GPU_COMPILE_CHECK"})
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    by_key = {r["key"]: r for r in summary["targets"]}
    assert by_key["qs16k_ms"]["verdict"] == "not measured"
    assert by_key["qs16k_ms"]["note"] == "step 'qs16k': cut at its limit (60 s)"
    assert by_key["vit_step_timm"]["note"] == "step 'vit' has not run"
    spills = by_key["no_spills_sm90"]
    assert spills["value"] == 1 and spills["verdict"] == "missed"
    assert "3.6.0" in spills["note"] and "_mlr_bwd_dq_kernel" in spills["note"]


def test_the_import_check_fails_fast_naming_the_missing_wheel(tmp_path):
    """Where mixer_plugins cannot be imported (here pydantic made missing), run.sh stops after the import check with
    one line naming the wheel, runs no measuring step, and still writes its summary."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "pydantic.py").write_text("raise ModuleNotFoundError(\"No module named 'pydantic'\", name='pydantic')\n")
    out = tmp_path / "out"
    result = _run_sh(out, "--dry", env={"PYTHONPATH": str(fake), "MIXER_PLUGINS_WHEELS": str(tmp_path / "none")})
    assert result.returncode == 1
    assert "IMPORT CHECK FAILED: cannot import 'pydantic': the wheel of pydantic is missing" in result.stdout
    log = (out / "log.txt").read_text()
    assert re.findall(r"^== (\w+) \(", log, flags=re.M) == ["install", "import", "summary", "done"]
    summary = json.loads((out / "summary.json").read_text())
    assert all(r["verdict"] == "not measured" for r in summary["targets"])
    assert {r["note"] for r in summary["targets"] if r["key"] == "vit_step_timm"} == {
        "step 'vit': not run: the import check failed"}
