"""The GPU check's closing table: one verdict row per target (``targets.py``), from whatever the run measured.

    python benchmarks/gpu/summary.py --out OUT [--quiet]

Reads what ``benchmarks/gpu/run.sh`` left in OUT (``environment.json``, ``steps.tsv``, the table scripts' JSON files,
the pytest XML files) and the sm_90 compile check's results (``compile_check*.json`` in OUT, else the newest under
``benchmarks/gpu/results/``, or the files named in ``MIXER_PLUGINS_GPU_COMPILE_CHECK``, separated by ``:``), and
writes ``OUT/summary.md`` and ``OUT/summary.json``; prints the Markdown unless ``--quiet``. Every target gets a row:
``held`` / ``missed`` with the value and the GPU it was measured on, or ``not measured`` and why (the step was cut,
failed or not run; the candidate could not run; a dry run's values, shown as such). run.sh runs this after every step,
so a run stopped from outside still has its table. Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import deadline  # noqa: E402  (benchmarks/gpu/deadline.py)
import targets as target_list  # noqa: E402  (benchmarks/gpu/targets.py)

#: the table scripts' results files, by run.sh step
RESULTS = {"qs16k": "qs16k.json", "vit": "vit.json", "launches": "launches.json", "mlr": "mlr_rows.json",
           "vit_compiled": "vit_compiled.json", "mamba": "mamba.json"}
#: the pytest steps' XML files
TESTS = {"scan correctness": "scan_tests.xml", "norm/conv correctness": "normconv_tests.xml",
         "GPU test files": "gpu_tests.xml"}
COMPILE_ENV = "MIXER_PLUGINS_GPU_COMPILE_CHECK"


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _load(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps(out: Path) -> dict[str, dict]:
    """run.sh's record of its steps (``steps.tsv``: name, status, seconds, limit), by name, in run order."""
    found: dict[str, dict] = {}
    path = out / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 4:
                found[parts[0]] = {"step": parts[0], "status": parts[1], "seconds": parts[2], "limit": parts[3]}
    return found


def _spill_count(report: dict) -> tuple[int, int, list[str]]:
    """(kernels that spill where the compile check forbids it, kernels compiled, the first few of them)."""
    import compile_check  # benchmarks/gpu/compile_check.py: its rules (no torch at import)

    bad = [f"{r['case']}: {r['kernel']} ({r['stack_bytes']} B stack)" for r in report.get("compiled", [])
           if r["case"].split(":")[0] in compile_check.SPILL_FREE
           and not r["case"].startswith(compile_check.SPILLS_ALLOWED) and (r["stack_bytes"] or r["local_bytes"])]
    return len(bad), len(report.get("compiled", [])), bad[:3]


def compile_reports(out: Path) -> list[Path]:
    """The compile-check results the spill target is read from (see the module docstring)."""
    if os.environ.get(COMPILE_ENV):
        return [Path(p) for p in os.environ[COMPILE_ENV].split(":") if p]
    here = sorted(out.glob("compile_check*.json"))
    if here:
        return here
    kept = sorted((HERE / "results").glob("**/compile_check*.json"), key=lambda p: p.stat().st_mtime)
    return kept[-1:]


def spill_measurement(out: Path) -> dict:
    """The ``no_spills_sm90`` target from the compile check's JSON files (no GPU needed: the check compiles for
    sm_90 on a CPU)."""
    paths = compile_reports(out)
    if not paths:
        return target_list.measurement(
            "no_spills_sm90", None, note="no compile-check results: run 'python benchmarks/gpu/compile_check.py "
                                         "--json OUT/compile_check.json' (a few minutes on a CPU)")
    total, compiled, notes = 0, 0, []
    for path in paths:
        report = _load(path)
        if not isinstance(report, dict) or report.get("arch") != 90:
            return target_list.measurement("no_spills_sm90", None, note=f"{path}: not an sm_90 compile check")
        bad, n, first = _spill_count(report)
        total, compiled = total + bad, compiled + n
        triton = report.get("triton") or (m.group(1) if (m := re.search(r"triton[-_]?(\d[\d.]*\d)", path.name))
                                          else "triton version not recorded")
        notes.append(f"{path.name} ({triton}): {bad} of {n}" + (f" ({'; '.join(first)})" if first else ""))
    m = target_list.measurement("no_spills_sm90", float(total), note="; ".join(notes), gpu="sm_90 compile (no GPU)")
    return m


def _junit(path: Path) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    count["passed"] = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    count["failed_tests"] = [f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
                             for case in root.iter("testcase")
                             if case.find("failure") is not None or case.find("error") is not None][:5]
    return count


def _rows(data: dict | None) -> list[dict]:
    return data.get("rows", []) if isinstance(data, dict) else []


def _ms(rows: list[dict], candidate: str, mode: str = "forward_backward") -> float | None:
    for r in rows:
        if r.get("candidate", "").startswith(candidate) and r.get("mode") == mode and r.get("ms") is not None:
            return r["ms"]
    return None


def other_measurements(results: dict[str, dict | None]) -> list[list[object]]:
    """Values measured without a target of their own: each timed row of the check's tables (forward+backward and
    training steps), then the fused scan's ratios to mamba-ssm and the compiled ViT's to the eager one."""
    out: list[list[object]] = []
    for step in ("qs16k", "vit", "vit_compiled", "mamba"):
        for r in _rows(results.get(step)):
            if r.get("mode") in ("forward_backward", "train_step") and r.get("ms") is not None:
                peak = "" if r.get("peak_total_mib") is None else f", peak {r['peak_total_mib']:.0f} MiB"
                out.append([step, f"{r['candidate']} (L = {r['length']}, batch {r['batch']})",
                            f"{r['ms']:.3f} ms{peak}", r.get("note", "")])
    for r in _rows(results.get("mlr")):
        if r.get("ratio") is not None and not r.get("verdict"):
            out.append(["mlr", f"{r['name']} (L = {r['length']}) / attention", f"{r['ratio']:.3f}x", r.get("note")])
    fused = _ms(_rows(results.get("qs16k")), "QS fused")
    for label in ("causal SSD", "released Hydra"):
        other = _ms(_rows(results.get("mamba")), label)
        if fused and other:
            out.append(["mamba", f"{label} (mamba-ssm, pinned) fwd+bwd / fused QS", f"{other / fused:.2f}x", ""])
    eager = _ms(_rows(results.get("vit")), "ViT-B/16 quasi", "train_step")
    compiled = _ms(_rows(results.get("vit_compiled")), "ViT-B/16 quasi", "train_step")
    timm = _ms(_rows(results.get("vit")), "ViT-B/16 attention (timm)", "train_step")
    if compiled and eager:
        out.append(["vit_compiled", "ViT-B/16 quasi step: compiled / eager", f"{compiled / eager:.2f}x", ""])
    if compiled and timm:
        out.append(["vit_compiled", "ViT-B/16 quasi step compiled / timm attention (eager)",
                    f"{compiled / timm:.2f}x", ""])
    return out


def _step_reason(step: str, recorded: dict[str, dict]) -> str:
    s = recorded.get(step)
    if s is None:
        return f"step {step!r} has not run"
    if s["status"] == "done":
        return f"step {step!r} ran but gave no value"
    return f"step {step!r}: {s['status']}"


def summarize(out: Path) -> dict:
    env = _load(out / "environment.json") or {}
    recorded = steps(out)
    results = {step: _load(out / name) for step, name in RESULTS.items()}
    dry = bool(env.get("dry"))
    gpu = env.get("gpu") or ("cpu (dry run)" if dry else None)
    found: dict[str, dict] = {}
    for data in results.values():
        if isinstance(data, dict):
            for m in data.get("targets", []):
                found.setdefault(m["key"], m)
    found["no_spills_sm90"] = spill_measurement(out)
    rows = []
    for target in target_list.TARGETS:
        m = found.get(target.key)
        value = None if m is None else m.get("value")
        is_dry = bool(m and m.get("dry"))
        held, stretch = target_list.verdict(target, value, dry=is_dry)
        if m is None:
            note = _step_reason(target.step, recorded)
        elif value is None and not is_dry:
            note = m.get("note") or _step_reason(target.step, recorded)
        else:
            note = ("dry run: CPU, tiny shapes, the value means nothing; " if is_dry else "") + (m.get("note") or "")
        rows.append({"key": target.key, "target": target.text, "bound": target.bound_text(), "value": value,
                     "verdict": held, "stretch": stretch, "dry": is_dry,
                     "gpu": (m or {}).get("gpu") or (gpu if value is not None else None), "note": note.strip("; ")})
    checks = []
    for name, file in TESTS.items():
        count = _junit(out / file)
        checks.append({"check": name, "file": file, **(count or {}),
                       "status": (recorded.get({"scan correctness": "scan_tests", "norm/conv correctness":
                                                "normconv_tests", "GPU test files": "gpu_tests"}[name]) or {})
                       .get("status", "not run")})
    mlr = results.get("mlr")
    if isinstance(mlr, dict) and mlr.get("checks"):
        ok = sum(1 for c in mlr["checks"] if c.get("ok"))
        checks.append({"check": "MLR and local attention kernels vs torch (mlr_rows.py)", "file": "mlr_rows.json",
                       "tests": len(mlr["checks"]), "passed": ok, "failures": len(mlr["checks"]) - ok,
                       "errors": 0, "skipped": 0, "failed_tests": [c["case"] for c in mlr["checks"]
                                                                   if not c.get("ok")][:5],
                       "status": (recorded.get("mlr") or {}).get("status", "")})
    return {"environment": env, "gpu": gpu, "dry": dry, "targets": rows, "checks": checks,
            "other": other_measurements(results), "steps": list(recorded.values())}


def _value_text(row: dict) -> str:
    v = row["value"]
    if v is None:
        return "-"
    text = f"{v:.3g}" if isinstance(v, float) else str(v)
    return f"{text} (dry)" if row["dry"] else text


def markdown(summary: dict) -> str:
    env = summary["environment"]
    versions = env.get("versions", {})
    head = (f"GPU: {summary['gpu'] or 'unknown'}" + (f" ({env.get('capability')}, {env.get('gpu_memory_gib')} GiB)"
                                                     if env.get("capability") else "")
            + f"; Python {env.get('python', '?')}; " + ", ".join(f"{k} {versions.get(k) or 'missing'}"
                                                              for k in ("torch", "triton", "timm", "mamba-ssm")))
    if summary["gpu"] and not summary["dry"] and "H100" not in summary["gpu"]:
        head += f"  \nThe targets must hold on an H100; these verdicts are on {summary['gpu']}."
    if env.get("problem"):
        head += f"\n\nIMPORT CHECK FAILED: {env['problem']}"
    held = [r for r in summary["targets"] if r["verdict"] == target_list.HELD]
    missed = [r for r in summary["targets"] if r["verdict"] == target_list.MISSED]
    lines = ["# GPU check: summary", "", head + ("  \nA dry run (CPU, Triton interpreter, tiny shapes): no target is "
                                                 "measured." if summary["dry"] else ""), "",
             f"{len(held)} held, {len(missed)} missed, {len(summary['targets']) - len(held) - len(missed)} not "
             f"measured, of {len(summary['targets'])} targets (targets.py).", "", "## Targets", "",
             _table(["target", "bound", "value", "verdict", "stretch", "measured on", "note"],
                    [[r["target"], r["bound"], _value_text(r), r["verdict"], r["stretch"], r["gpu"] or "-", r["note"]]
                     for r in summary["targets"]]), ""]
    if summary["checks"]:
        lines += ["## Correctness", "", _table(
            ["check", "passed", "failed", "errors", "skipped", "step", "failing"],
            [[c["check"], c.get("passed", "-"), c.get("failures", "-"), c.get("errors", "-"), c.get("skipped", "-"),
              c.get("status", ""), "; ".join(c.get("failed_tests", []))] for c in summary["checks"]]), ""]
    if summary["other"]:
        lines += ["## Other measurements (no target)", "", _table(["step", "what", "value", "note"],
                                                                  summary["other"]), ""]
    if summary["steps"]:
        lines += ["## Steps (in run order)", "", _table(["step", "status", "seconds", "limit (s)"], [
            [s["step"], s["status"], s["seconds"], s["limit"]] for s in summary["steps"]]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the GPU check's results folder")
    parser.add_argument("--quiet", action="store_true", help="write the files only")
    args = parser.parse_args(argv)
    summary = summarize(args.out)
    text = markdown(summary)
    deadline.write_text(args.out / "summary.json", json.dumps(summary, indent=2, default=str))
    deadline.write_text(args.out / "summary.md", text + "\n")
    if not args.quiet:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
