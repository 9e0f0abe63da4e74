"""``mixer-plugins list``: a table of every registered mixer, at most 120 columns wide (long cells wrap; the details
are in ``info``), the mixers of other distributions named under it, and any broken plugin.

``list --names`` prints the names alone, from the installed entry points' metadata: it imports no mixer code (nor
torch), so it answers at once. The table needs every spec, so it imports every plugin (and torch); a broken plugin
is reported on stderr.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from ..._text import format_table
from .args import Command
from .layout import fit_table, terminal_width, wrap

__all__ = ["COMMAND", "entry_point_names"]

#: the table's widest layout (narrower terminals: narrower, down to 80); long cells wrap, details are in ``info``
MAX_WIDTH = 120

#: this package's distribution: the mixers it registers are the built-in ones (others are named under the table)
OWN_DISTRIBUTION = "mixer-plugins"

#: ``mixer_plugins.registry.ENTRY_POINT_GROUP`` (the registry imports torch; a test keeps the two equal).
ENTRY_POINT_GROUP = "mixer_plugins.mixers"


def entry_point_names(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Every mixer name declared by an installed distribution, sorted, as the registry lists them (names equal
    up to case and ``-``/``_`` counted once). Reads metadata only: imports neither plugins nor torch."""
    from importlib import metadata

    names: dict[str, str] = {}
    for ep in metadata.entry_points(group=group):
        names.setdefault(ep.name.strip().lower().replace("-", "_"), ep.name)
    return sorted(names.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--names", action="store_true",
                        help="print the names only, one a line (fast: reads metadata, imports no mixer code)")


def run(args: argparse.Namespace) -> int:
    if args.names:
        print("\n".join(entry_point_names()))
        return 0
    from ...registry import MixerPluginWarning, default_registry  # cheap: neither torch nor pydantic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixerPluginWarning)  # reported below instead
        specs, problems = default_registry.catalog()
    rows = [(s.name, ", ".join(s.aliases) or "-", s.matrix_class or "-", s.direction, s.complexity or "-",
             s.data_dependent) for s in specs]
    headers = ("name", "aliases", "matrix class", "direction", "complexity", "data-dependent")
    width = terminal_width(MAX_WIDTH, at_most=MAX_WIDTH, at_least=80)
    print(fit_table(headers, rows, width, wrapping=(1, 2, 4), minimum={1: 22, 2: 20, 4: 14})
          or format_table(headers, rows))
    others = [s for s in specs if s.distribution != OWN_DISTRIBUTION]
    if others:
        print()
        print(wrap("from other distributions: " + ", ".join(f"{s.name} ({s.distribution or 'unknown'})"
                                                           for s in others), width, "  "))
    if problems:
        print(f"\n{len(problems)} plugin problem(s):", file=sys.stderr)
        for problem in problems:
            print(f"  [{problem.kind}] {problem.message}", file=sys.stderr)
    return 0


COMMAND = Command("list every registered mixer", run, add_arguments)
