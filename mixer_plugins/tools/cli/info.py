"""``mixer-plugins info NAME``: a mixer's description and options (type, default and help), fitted to the terminal."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .args import Command
from .layout import fit_table, terminal_width, user_type, wrap

if TYPE_CHECKING:  # pragma: no cover
    from ...registry import MixerSpec

__all__ = ["COMMAND", "option_rows"]

#: the help column is never narrower: below it each option is printed as a paragraph instead of a table row
MIN_HELP_WIDTH = 24


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="mixer name or alias")


def option_rows(spec: MixerSpec) -> list[tuple[str, str, str, str]]:
    """(option, type as a user writes it, default, help) for each option of ``spec``'s config."""
    fields = spec.config.model_fields
    return [(name, user_type(fields[name].annotation), default, help_text)
            for name, _, default, help_text in spec.options_table()]


def render(spec: MixerSpec, width: int) -> str:
    """What ``info`` prints for ``spec`` in ``width`` columns."""
    lines = [wrap(f"{spec.name}: {spec.summary}", width, "  ")]
    if spec.aliases:
        lines.append(wrap(f"aliases: {', '.join(spec.aliases)}", width, "  "))
    facts = [f"matrix class: {spec.matrix_class or '-'}", f"direction: {spec.direction}",
             f"complexity: {spec.complexity or '-'}", f"data-dependent: {spec.data_dependent}",
             f"distribution: {spec.distribution or '-'}"]
    lines.append(wrap(" | ".join(facts), width, "  "))
    lines.append("")
    rows = option_rows(spec)
    # types and defaults stay whole up to a point; the help column wraps first
    whole_type = min(24, max((len(r[1]) for r in rows), default=0))
    whole_default = min(12, max((len(r[2]) for r in rows), default=0))
    table = fit_table(("option", "type", "default", "help"), rows, width, wrapping=(1, 2, 3),
                      minimum={1: whole_type, 2: whole_default, 3: MIN_HELP_WIDTH})
    if table is not None:
        lines.append(table)
    else:  # too narrow for four columns: one paragraph per option
        for name, type_name, default, help_text in rows:
            lines.append(wrap(f"{name}: {type_name} = {default}", width, "    "))
            if help_text:
                lines.append(wrap("    " + help_text, width, "    "))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ...registry import default_registry

    print(render(default_registry.get_spec(args.name), terminal_width(100)))
    return 0


COMMAND = Command("show a mixer's options", run, add_arguments)
