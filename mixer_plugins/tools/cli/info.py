"""``mixer-plugins info NAME``: a mixer's options, with type, default and help."""

from __future__ import annotations

import argparse

from ..._text import format_table
from ...errors import MixerError
from .args import CliError, Command

__all__ = ["COMMAND"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="mixer name or alias")


def run(args: argparse.Namespace) -> int:
    from ...registry import default_registry

    try:
        spec = default_registry.get_spec(args.name)
    except MixerError as err:
        raise CliError(str(err)) from None
    print(f"{spec.name}: {spec.summary}")
    if spec.aliases:
        print(f"aliases: {', '.join(spec.aliases)}")
    print(
        f"matrix class: {spec.matrix_class or '-'} | direction: {spec.direction} | "
        f"complexity: {spec.complexity or '-'} | data-dependent: {spec.data_dependent} | "
        f"distribution: {spec.distribution or '-'}"
    )
    print()
    print(format_table(("option", "type", "default", "help"), spec.options_table()))
    return 0


COMMAND = Command("show a mixer's options", run, add_arguments)
