"""``mixer-plugins list``: a table of every registered mixer (and any broken plugin)."""

from __future__ import annotations

import argparse
import sys
import warnings

from ..._text import format_table
from .args import Command

__all__ = ["COMMAND"]


def run(args: argparse.Namespace) -> int:
    from ...registry import MixerPluginWarning, default_registry

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixerPluginWarning)  # reported below instead
        specs = default_registry.specs()
        problems = default_registry.problems()
    rows = [
        (
            s.name,
            ", ".join(s.aliases) or "-",
            s.matrix_class or "-",
            s.direction,
            s.complexity or "-",
            s.data_dependent,
            s.distribution or "-",
        )
        for s in specs
    ]
    headers = ("name", "aliases", "matrix class", "direction", "complexity", "data-dependent", "distribution")
    print(format_table(headers, rows))
    if problems:
        print(f"\n{len(problems)} plugin problem(s):", file=sys.stderr)
        for problem in problems:
            print(f"  [{problem.kind}] {problem.message}", file=sys.stderr)
    return 0


COMMAND = Command("list every registered mixer", run)
