"""The comparison table of benchmark results: from ``mixer-plugins bench`` and from pytest-benchmark's saved JSON.

Both sources become the same rows (one per mixer x length x batch x mode: ``mixer``, ``length``, ``batch``,
``dim``, ``mode``, ``seconds``, ``flops``, ``peak_memory_bytes``, ...) and the same table: one section per
(run, mode, dim, batch), rows ordered by length, with time, tokens/s, counted FLOPs, achieved FLOP/s, peak memory
and the time and memory ratios to a baseline mixer (``attention``) at the same size. Ratios below 1 mean the mixer
is faster / lighter than the baseline.

pytest-benchmark writes JSON with ``--benchmark-autosave`` (under ``.benchmarks/<machine>/NNNN_*.json``) or
``--benchmark-json=FILE``; each benchmark's ``extra_info`` carries what the fixture in ``benchmarks/conftest.py``
recorded and ``stats.median`` the time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._text import format_table, markdown_table
from ..errors import MixerError
from .benchmarking import format_bytes, format_flops, format_seconds

__all__ = ["BenchmarkFileError", "find_benchmark_files", "load_benchmark_rows", "results_table"]


class BenchmarkFileError(MixerError):
    """A path given to ``bench-table`` is missing or is not pytest-benchmark JSON."""


def find_benchmark_files(paths: Sequence[str | Path], *, every_run: bool = False) -> list[Path]:
    """JSON files for ``paths``: files as given; for a directory its newest ``*.json`` (all of them with
    ``every_run``), searched recursively as pytest-benchmark's autosave nests them per machine."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(path.rglob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
            if not found:
                raise BenchmarkFileError(
                    f"no benchmark JSON under {str(path)!r}; save some with: pytest benchmarks --benchmark-autosave"
                )
            files.extend(found if every_run else found[-1:])
        else:
            raise BenchmarkFileError(f"no such file or directory: {str(path)!r}")
    return files


def _row_from_benchmark(bench: Mapping[str, Any], run: str) -> dict[str, Any] | None:
    info = dict(bench.get("extra_info") or {})
    stats = bench.get("stats") or {}
    if "mixer" not in info or "length" not in info or stats.get("median") is None:
        return None
    seconds = float(stats["median"])
    row = {
        "run": run,
        "mixer": info["mixer"],
        "length": int(info["length"]),
        "batch": info.get("batch"),
        "dim": info.get("dim"),
        # Suites that do not record a mode are labelled by their pytest-benchmark group.
        "mode": info.get("mode") or f"group {bench.get('group') or bench.get('name')}",
        "seconds": seconds,
        "flops": info.get("flops"),
        "analytic_flops": info.get("analytic_flops"),
        "peak_memory_bytes": info.get("peak_memory_bytes"),
    }
    if row["flops"] is not None and seconds > 0:
        row["flops_per_second"] = row["flops"] / seconds
    if row["batch"] is not None and seconds > 0:
        row["tokens_per_second"] = row["batch"] * row["length"] / seconds
    return row


def load_benchmark_rows(files: Iterable[str | Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of every mixer benchmark in pytest-benchmark JSON ``files``, and the names of benchmarks left out
    (those without ``mixer``/``length`` in ``extra_info``, e.g. pass/fail targets, or runs with timing disabled)."""
    rows: list[dict[str, Any]] = []
    left_out: list[str] = []
    for file in files:
        path = Path(file)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise BenchmarkFileError(f"cannot read {str(path)!r} as JSON: {err}") from None
        if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
            raise BenchmarkFileError(
                f"{str(path)!r} is not pytest-benchmark JSON (no 'benchmarks' list); write it with "
                "--benchmark-autosave or --benchmark-json=FILE"
            )
        for bench in data["benchmarks"]:
            row = _row_from_benchmark(bench, path.stem)
            if row is None:
                left_out.append(str(bench.get("fullname") or bench.get("name")))
            else:
                rows.append(row)
    return rows, left_out


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def results_table(rows: Sequence[Mapping[str, Any]], *, baseline: str | None = "attention",
                  markdown: bool = False) -> str:
    """The comparison table of ``rows`` (see the module docstring); ``markdown`` for a pipe table; no ratio
    columns when ``baseline`` is None."""
    sections: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        key = (row.get("run"), row.get("mode"), row.get("dim"), row.get("batch"))
        sections.setdefault(key, []).append(row)
    # Mixers run in their default direction may mix causal and bidirectional ones: then say which is which.
    mixed_directions = len({row.get("direction") for row in rows if row.get("direction")}) > 1
    runs = {row.get("run") for row in rows}
    mixer_order = {name: i for i, name in enumerate(dict.fromkeys(row["mixer"] for row in rows))}
    headers: tuple[str, ...] = ("mixer", "L", "time", "tokens/s", "FLOPs", "FLOP/s", "peak mem")
    if baseline is not None:
        headers += (f"time / {baseline}", f"mem / {baseline}")
    out: list[str] = []
    for (run, mode, dim, batch), members in sections.items():
        base = {r["length"]: r for r in members if r["mixer"] == baseline}
        body = []
        for r in sorted(members, key=lambda r: (r["length"], mixer_order[r["mixer"]])):
            label = f"{r['mixer']} ({r['direction']})" if mixed_directions and r.get("direction") else r["mixer"]
            cells = [
                label, r["length"], format_seconds(r.get("seconds")), format_flops(r.get("tokens_per_second")),
                format_flops(r.get("flops")), format_flops(r.get("flops_per_second")),
                format_bytes(r.get("peak_memory_bytes")),
            ]
            if baseline is not None:
                ref = base.get(r["length"])
                cells += [_ratio(r.get("seconds"), ref.get("seconds") if ref else None),
                          _ratio(r.get("peak_memory_bytes"), ref.get("peak_memory_bytes") if ref else None)]
            body.append(cells)
        directions = {r.get("direction") for r in members}
        direction = directions.pop() if len(directions) == 1 else None
        title = ", ".join(str(p) for p in (
            mode, direction, f"dim {dim}" if dim is not None else None, f"batch {batch}" if batch is not None else None,
            f"run {run}" if run is not None and len(runs) > 1 else None) if p is not None)
        if markdown:
            out.append(f"**{title}**\n\n{markdown_table(headers, body)}")
        else:
            out.append(f"{title}\n{format_table(headers, body)}")
    return "\n\n".join(out)
