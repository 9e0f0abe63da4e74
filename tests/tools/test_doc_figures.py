"""Every measured figure the documentation quotes comes from a results file or from the code.

**Sources.** A page that quotes figures names where they come from in an HTML comment (anywhere but its opening
paragraph; the site does not show it)::

    <!-- figures: benchmarks/results/2026-12-02-speed-ratios.json, code:compare-reports -->

Each source is either a file of the repository -- a results file that a script in ``benchmarks/`` or the tool
itself wrote (JSON, or the text a command printed), or a script whose settings the page quotes -- or ``code:NAME``,
figures this module computes from the code each time it runs (:data:`CODE_SOURCES`: FLOP and parameter counts, the
tables ``mixer-plugins compare --from`` prints), because they are cheap to regenerate and so are not stored.

**Figures** (outside fenced code, inline code and link targets): a number with a unit of time (``ns``, ``us``,
``ms``, ``s``, ``min``, ``minutes``, ``seconds``, ``h``, ``hours``), memory (``KiB``, ``MiB``, ``GiB``, ``kB``,
``MB``, ``GB``...), work or rate (``FLOPs``, ``GFLOP``, ``GFLOP/s``, ``tokens/s``, ``images/s``), a ratio (``x``,
``×``) or a percentage, ranges of them (``1.3-1.7x``); a count with an SI suffix ending a table cell
(``| 7.38 M |``); a value with its spread (``0.989 ± 0.010``, ``9.85 [8.84, 10.72]``); any decimal number
(``8.3-10.4``, ``0.29 accuracy``; not a version such as ``2.9.1``); and, on a page that names sources, every number
of a table cell that holds nothing but figures. Not figures: bounds (a number right after ``<=``, ``>=``, ``≤``,
``≥``, ``<``, ``>``, "at most", "at least", "within", "more than" or "less than"), settings named right before their
value (:data:`SETTING`: ``weight decay 0.05``), dimensions (``16 x 16``), and the constants of :data:`CONSTANTS`,
each with its reason.

**Checks.** On a page that names sources, each number of each figure appears among the numbers of its sources,
written as the page writes it (a JSON number counts at every rounding from 0 to 4 decimals; numbers inside
strings and text files count as written; thousands separators are ignored). A page that names no source quotes
no figure. A table a results file holds (``"tables"``: columns, alignment, rows as the page writes them) appears in
the page verbatim; so do the tables ``mixer-plugins compare --from`` prints for the recorded runs and the stored
FLOP table, whose analytic columns are checked against the mixers. No page keeps a phrase of a development diary or
a status line that ages (:data:`DIARY`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
UNIT = (r"(?:ns|us|µs|ms|s|sec|min|minutes?|seconds?|h|hours?|KiB|MiB|GiB|TiB|kB|KB|MB|GB|TB|"
        r"G?FLOPs?|TFLOPs?|G?FLOP/s|TFLOP/s|tokens/s|images/s|%|(?:x|×)(?!\s?\d))")
_UNIT_FIGURE = rf"(?<![\w.]){NUM}(?:\s?[-–]\s?{NUM})?\s?{UNIT}(?![\w/])"
_SI_CELL = rf"(?<![\w.]){NUM}\s?[kMGT](?=\s*\|)"
_SPREAD = rf"(?<![\w.]){NUM}\s?(?:±\s?{NUM}|\[{NUM}(?:,\s?|\s?[-–]\s?){NUM}\])"
_DECIMAL = r"(?<![\w.])\d+\.\d+(?!\.?\d)"  # a decimal number (not a version such as 2.9.1)
FIGURE = re.compile(f"{_SPREAD}|{_UNIT_FIGURE}|{_SI_CELL}|{_DECIMAL}")
#: a setting named right before its value (``weight decay 0.05``, ``driver 580.159``): a setting, not a measurement
SETTING = re.compile(r"\b(?:lr|wd|weight decay|std|depth|dropout|default|driver|python|torch|triton|version)"
                     r"\s*[=:]?\s*$", re.I)
BOUND = re.compile(r"(?:<=|>=|≤|≥|<|>|\bat most|\bat least|\bwithin|\bmore than|\bless than)\s*$")
SOURCES = re.compile(r"<!--\s*figures:\s*(.*?)\s*-->", re.S)
FIGURE_CELL = re.compile(rf"(?:{UNIT}|[kMGT]\b|[\d\s.,±\[\]()\-–/%×*:;]|one rep\.)*")

#: figures that are not measurements: (page, figure as written) -> why it needs no source
CONSTANTS: dict[tuple[str, str], str] = {
    ("README.md", "2 ×"): "two semiseparable matrices, in the matrix class column",
    ("docs/performance.md", "32 MiB"): "glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)",
    ("docs/kernels.md", "32 MiB"): "glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)",
    ("docs/limits.md", "32 MiB"): "glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)",
    ("docs/distributed.md", "32 MiB"): "glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)",
    ("docs/structured_attention.md", "3x"): "PyTorch's convention for the attention backward's score FLOPs",
    ("docs/structured_attention.md", "2x"): "PyTorch's convention for the attention backward's value FLOPs",
    ("docs/flops.md", "3×"): "two matmuls per forward matmul in the backward: arithmetic",
    ("docs/flops.md", "3.5×"): "five L²·d matmuls against two: arithmetic",
    ("docs/structured_attention.md", "16 MiB"): "16384 x 256 float32 values: arithmetic",
    ("docs/flops.md", "2 FLOPs"): "the convention: 2 FLOPs per multiply-add",
}

#: sources of pages this project does not let carry the comment themselves (README.md is written by its owner)
#: a page that quotes one figure of a results file without its tables (which the pages that name the file show)
OTHER_SOURCES: dict[str, list[str]] = {
    "README.md": ["benchmarks/results/2026-11-30-context-parallel.json"],
}

#: phrases of a development diary, or status lines that age: a page states what is
DIARY = {
    r"\bnot yet\b": "a status that ages",
    r"\btoday(?:'s)?\b": "a status that ages",
    r"\bas they are now\b": "a status that ages",
    r"\b\d{1,2}:\d{2}(?:-\d{1,2}:\d{2})?\s*UTC\b": "a clock time",
    r"\bwas asked for\b": "why something was done, not what it is",
    r"\bother helpers\b|machine[^.|]*shared with (?:the )?other": "who else used the machine",
    r"\bneeded quiet\b|\bhad to be quiet\b|\bhad to end\b": "a deadline",
    r"\bfor this page\b": "how the page was written",
}


def rel(path: Path, root: Path = REPO) -> str:
    """The path as the messages and :data:`CONSTANTS` write it."""
    return path.relative_to(root).as_posix()


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a page outside fenced code, with inline code, link targets and HTML comments blanked
    (so that positions and line numbers stay those of the page)."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"<!--.*?-->", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if re.match(r"^\s*```", line):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)
        line = re.sub(r"\]\([^)]*\)", lambda m: "]" + " " * (len(m.group(0)) - 1), line)
        yield number, line


def figures(path: Path, *, table_numbers: bool, root: Path = REPO) -> list[tuple[int, str]]:
    """The page's figures as ``(line, text)``: see the module's docstring (``table_numbers``: also every number of
    a table cell that holds nothing but figures)."""
    found = []
    for number, line in prose_lines(path):
        spans = []
        for match in FIGURE.finditer(line):
            if BOUND.search(line[:match.start()]) or SETTING.search(line[:match.start()]):
                continue
            if (rel(path, root), match.group(0)) in CONSTANTS:
                continue
            found.append((number, match.group(0)))
            spans.append(match.span())
        if table_numbers and line.lstrip().startswith("|") and not re.fullmatch(r"[\s|:\-]+", line):
            offset = line.index("|") + 1
            for cell in line.strip().strip("|").split("|"):
                start = line.index(cell, offset)
                offset = start + len(cell)
                if not re.search(r"\d", cell) or not FIGURE_CELL.fullmatch(cell.strip()):
                    continue
                for match in re.finditer(rf"(?<![\w.]){NUM}", cell):
                    where = start + match.start()
                    if not any(a <= where < b for a, b in spans) and not BOUND.search(line[:where]):
                        found.append((number, match.group(0)))
    return found


def declared_sources(path: Path, root: Path = REPO) -> list[str]:
    """The sources a page names (and those :data:`OTHER_SOURCES` names for it)."""
    named = [s.strip() for block in SOURCES.findall(path.read_text(encoding="utf-8")) for s in block.split(",")
             if s.strip()]
    return named + OTHER_SOURCES.get(rel(path, root), [])


def numbers_in(text: str) -> set[str]:
    """The numbers of a text as written (without thousands separators)."""
    return {n.replace(",", "") for n in re.findall(NUM, text)}


def json_numbers(value: object) -> set[str]:
    """Every number of a JSON document as a page may write it: numbers at every rounding from 0 to 4 decimals,
    numbers inside strings as written."""
    out: set[str] = set()
    if isinstance(value, bool):
        return out
    if isinstance(value, dict):
        for key, item in value.items():
            out |= numbers_in(str(key)) | json_numbers(item)
    elif isinstance(value, list):
        for item in value:
            out |= json_numbers(item)
    elif isinstance(value, int):
        out.add(str(value))
    elif isinstance(value, float):
        out |= {f"{value:.{d}f}" for d in range(5)}
    elif isinstance(value, str):
        out |= numbers_in(value)
    return out


# -- sources computed from the code ---------------------------------------------------------------------------

def _compare_reports() -> str:
    """What ``mixer-plugins compare --from`` prints for each recorded run in docs/compare/runs/."""
    from mixer_plugins.tools.compare import CompareResult

    return "\n\n".join(CompareResult.load(path).recount().report()
                       for path in sorted((REPO / "docs" / "compare" / "runs").glob("*.json")))


def _flops_analytic() -> str:
    """The analytic columns of docs/flops.md's table (batch 1, dim 256, L 1024, default options), and the sliding-
    window example under it, from each mixer's ``flops_breakdown`` (no forward pass)."""
    import mixer_plugins as mp
    from mixer_plugins.tools.benchmarking import build_mixer, format_flops

    lines = []
    for name in mp.list_mixers():  # plugins included, as `mixer-plugins flops` lists them
        parts = build_mixer(name, 256, 1024).flops_breakdown(1, 1024)
        uncounted = sum(v for k, v in parts.items() if k.endswith("_elementwise"))
        lines.append(f"{name}: {format_flops(sum(parts.values()))}, {format_flops(uncounted) if uncounted else 0}")
    window = build_mixer("sliding_window_attention", 256, 4096, options={"window": 64})
    lines.append(f"window 64 at 4096: {format_flops(window.flops(1, 4096))}; "
                 f"attention: {format_flops(build_mixer('attention', 256, 4096).flops(1, 4096))}")
    return "\n".join(lines)


def _mlr_flops() -> str:
    """docs/structured_attention.md's FLOPs: the op of the paper's MLR attention (dim 256, 4 heads, causal), counted
    and as the ``matmul`` engine executes it, in GFLOP at 0, 1 and 2 decimals; its score FLOPs against dense
    attention's at L = 1024."""
    import mixer_plugins as mp
    from mixer_plugins.kernels.mlr_attention import mlr_attention_flops

    mlr = mp.create_mixer("mlr_attention", 256, num_heads=4, ranks=[32, 8, 6, 4, 4, 4, 4, 2], causal=True)
    lines = []
    for length in (1024, 4096, 16384):
        for executed in (False, True):
            flops = sum(mlr_attention_flops(1, mlr.num_heads, length, ranks=mlr.ranks, block_sizes=mlr.block_sizes,
                                            value_width=mlr.head_dim, causal=True, executed=executed).values())
            lines.append(f"{length} executed={executed}: " + " ".join(f"{flops / 1e9:.{d}f}" for d in range(3)))
    scores = mlr_attention_flops(1, mlr.num_heads, 1024, ranks=mlr.ranks, block_sizes=mlr.block_sizes,
                                 value_width=mlr.head_dim)["scores"]
    lines.append(f"score FLOPs / dense at 1024: {scores / (2 * mlr.num_heads * 1024 * 1024 * mlr.head_dim):.2f}")
    return "\n".join(lines)


CODE_SOURCES: dict[str, Callable[[], str]] = {
    "compare-reports": _compare_reports,
    "flops-analytic": _flops_analytic,
    "mlr-flops": _mlr_flops,
}


@cache
def source_numbers(source: str, root: Path = REPO) -> frozenset[str]:
    """The numbers a source holds (see the module's docstring)."""
    if source.startswith("code:"):
        name = source.removeprefix("code:")
        assert name in CODE_SOURCES, f"unknown source {source}; known: {sorted(CODE_SOURCES)}"
        return frozenset(numbers_in(CODE_SOURCES[name]()))
    path = root / source
    assert path.is_file(), f"source {source} does not exist"
    text = path.read_text(encoding="utf-8")
    return frozenset(json_numbers(json.loads(text)) if path.suffix == ".json" else numbers_in(text))


def unsourced(path: Path, root: Path = REPO) -> list[str]:
    """The figures of a page that its sources do not contain (all of them when it names none)."""
    sources = declared_sources(path, root)
    known: set[str] = set()
    for source in sources:
        known |= source_numbers(source, root)
    missing = []
    for line, figure in figures(path, table_numbers=bool(sources), root=root):
        absent = [n for n in re.findall(NUM, figure) if n.replace(",", "") not in known]
        if absent:
            missing.append(f"{rel(path, root)}:{line}: {figure!r}" + (f" ({', '.join(absent)} not in its sources)"
                                                                 if sources else " (the page names no source)"))
    return missing


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_figure_comes_from_a_named_source(page):
    missing = unsourced(page)
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_diary_phrases_or_status_lines(page):
    found = [f"{rel(page)}:{line}: {match.group(0)!r} ({why})" for line, text in prose_lines(page)
             for pattern, why in DIARY.items() for match in re.finditer(pattern, text, re.I)]
    assert not found, "\n".join(found)


def test_every_constant_is_still_quoted():
    """An entry of CONSTANTS whose page no longer has the figure is removed, so the list does not rot."""
    stale = [f"{page}: {figure!r}" for page, figure in CONSTANTS
             if figure not in "\n".join(text for _, text in prose_lines(REPO / page))]
    assert not stale, stale


def test_the_figure_checker_can_fail(tmp_path):
    """Figures are found with their units and spreads, bounds and dimensions are not figures, and a number its
    source lacks (or a page without sources) is reported."""
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"median": 9.8512, "peak": {"mib": 415.0}, "note": "7.38 M FLOPs"}))
    page = tmp_path / "page.md"
    page.write_text("# T\n\nIt peaks at 415 MiB and 1565 MiB, ratio 9.85 [8.84, 10.72]; target <= 1.5x, "
                    "`12 ms` in code, 16 x 16 patches, torch 2.9.1, weight decay 0.05, medians 8.3-10.4.\n\n"
                    "| a | b |\n|---|---|\n| x | 7.38 M |\n| y | 0.3 / 2 |\n", encoding="utf-8")
    found = [f for _, f in figures(page, table_numbers=True, root=tmp_path)]
    assert found == ["415 MiB", "1565 MiB", "9.85 [8.84, 10.72]", "8.3", "10.4", "7.38 M", "0.3", "2"], found
    assert len(unsourced(page, tmp_path)) == 7  # no source: every figure outside the figure-only cells
    page.write_text(page.read_text() + "\n<!-- figures: results.json -->\n", encoding="utf-8")
    assert [m.split(": ", 1)[1] for m in unsourced(page, tmp_path)] == [
        "'1565 MiB' (1565 not in its sources)", "'9.85 [8.84, 10.72]' (8.84, 10.72 not in its sources)",
        "'8.3' (8.3 not in its sources)", "'10.4' (10.4 not in its sources)",
        "'0.3' (0.3 not in its sources)", "'2' (2 not in its sources)"]
    assert json_numbers(9.8512) >= {"10", "9.9", "9.85", "9.851"} and "9.8" not in json_numbers(9.8512)


# -- tables that must appear verbatim -------------------------------------------------------------------------

def markdown_table(table: dict) -> str:
    """A results file's table (``columns``, ``align``: ``"r"`` for right-aligned, ``rows``) as the page writes it."""
    separator = "|" + "|".join("---:" if a == "r" else "---" for a in table["align"]) + "|"
    return "\n".join(["| " + " | ".join(table["columns"]) + " |", separator,
                      *("| " + " | ".join(row) + " |" for row in table["rows"])])


def test_the_tables_of_results_files_appear_in_the_pages_that_name_them():
    checked = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for source in (s.strip() for block in SOURCES.findall(text) for s in block.split(",")):
            if not source.endswith(".json"):
                continue
            for name, table in json.loads((REPO / source).read_text()).get("tables", {}).items():
                assert markdown_table(table) in text, f"{rel(page)} does not show table {name!r} of {source}"
                checked += 1
    assert checked >= 5


def test_the_compare_page_shows_what_compare_from_prints():
    """docs/compare.md's result tables are ``mixer-plugins compare --from docs/compare/runs/<preset>.json``: the
    recorded metrics and times, the FLOPs and parameters this version counts, the verdicts of the current rule."""
    from mixer_plugins.tools.compare import CompareResult

    text = (REPO / "docs" / "compare.md").read_text(encoding="utf-8")
    runs = sorted((REPO / "docs" / "compare" / "runs").glob("*.json"))
    assert len(runs) == 3
    for path in runs:
        result = CompareResult.load(path).recount()
        report = result.report()
        for part in report.split("\n\n"):  # the settings line, the table, the reference, the verdicts
            assert part in text, f"docs/compare.md does not show what compare --from {rel(path)} prints:\n{part}"
        verdicts = [c["verdict"] for c in result.check_orderings()]
        assert verdicts and all(v.startswith("inconclusive (fewer than 3 seeds") for v in verdicts)  # two seeds


def test_the_stored_flop_table_is_the_pages_and_the_codes():
    """docs/flops.md shows benchmarks/results/flops-dim256-L1024.md (``mixer-plugins flops --markdown``), whose
    analytic columns are what each mixer's ``flops_breakdown`` gives now."""
    stored = (REPO / "benchmarks" / "results" / "flops-dim256-L1024.md").read_text(encoding="utf-8")
    table = stored[stored.index("| mixer |"):].strip()
    assert table in (REPO / "docs" / "flops.md").read_text(encoding="utf-8")
    import mixer_plugins as mp

    analytic = dict(line.split(": ", 1) for line in _flops_analytic().splitlines() if not line.startswith("window"))
    rows = {cells[0]: f"{cells[1]}, {cells[2]}" for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:])}
    built_in = {n for n in mp.list_mixers() if mp.get_spec(n).distribution == "mixer-plugins"}
    assert built_in <= set(rows), f"mixers missing from the stored table: {sorted(built_in - set(rows))}"
    stale = {name: (row, analytic[name]) for name, row in rows.items() if name in analytic and row != analytic[name]}
    assert not stale, f"rerun mixer-plugins flops --markdown (see the file's first line): {stale}"


def test_the_speed_ratio_table_is_what_the_script_prints_from_its_results():
    """docs/performance.md's table is ``benchmarks/speed_ratios.py --table run1.json run2.json``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_speed_ratios", REPO / "benchmarks" / "speed_ratios.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = REPO / "benchmarks" / "results" / "2026-12-05-cpu-speed-ratios"
    table = module.markdown_table([json.loads((folder / f"{run}.json").read_text()) for run in ("run1", "run2")])
    assert table in (REPO / "docs" / "performance.md").read_text(encoding="utf-8"), table
