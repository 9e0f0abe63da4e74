"""``mixer-plugins bench-table PATH``: the comparison table of pytest-benchmark's saved JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .args import CliError, Command

__all__ = ["COMMAND"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help="pytest-benchmark JSON files, or folders (e.g. .benchmarks): their newest JSON")
    parser.add_argument("--all-runs", action="store_true", help="for folders, every saved run, not just the newest")
    parser.add_argument("--baseline", default="attention", help="mixer the ratios refer to (default: attention)")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")


def run(args: argparse.Namespace) -> int:
    from ..tables import find_benchmark_files, load_benchmark_rows, results_table

    files = find_benchmark_files(args.paths, every_run=args.all_runs)
    rows, left_out = load_benchmark_rows(files)
    if not rows:
        raise CliError(f"no mixer benchmarks with timings in {', '.join(map(str, files))} (was timing disabled? "
                       "save runs with: pytest benchmarks --benchmark-only --benchmark-autosave)")
    print(results_table(rows, baseline=args.baseline, markdown=args.markdown))
    if left_out:
        print(f"\n{len(left_out)} benchmark(s) without mixer/length information left out: "
              + ", ".join(left_out[:5]) + (" ..." if len(left_out) > 5 else ""), file=sys.stderr)
    return 0


COMMAND = Command("comparison table of pytest-benchmark's saved JSON (the benchmarks/ suites)", run, add_arguments)
