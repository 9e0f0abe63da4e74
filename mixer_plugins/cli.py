"""The ``mixer-plugins`` command line.

    mixer-plugins list               a table of every registered mixer (and any broken plugin)
    mixer-plugins info NAME          a mixer's options: type, default and help

Bad arguments exit with status 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "build_parser", "format_table"]


class CliError(Exception):
    """An error reported as one line on stderr, exit status 2."""


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table with aligned columns."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*cells[0]).rstrip(), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r).rstrip() for r in cells[1:]]
    return "\n".join(lines)


def _cmd_list(args: argparse.Namespace) -> int:
    import warnings

    import mixer_plugins as mp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mp.MixerPluginWarning)  # reported below instead
        specs = mp.list_specs()
        problems = mp.plugin_problems()
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


def _cmd_info(args: argparse.Namespace) -> int:
    import mixer_plugins as mp

    try:
        spec = mp.get_spec(args.name)
    except mp.MixerError as err:
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


@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    run: Callable[[argparse.Namespace], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None


def _info_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="mixer name or alias")


COMMANDS: dict[str, Command] = {
    "list": Command("list every registered mixer", _cmd_list),
    "info": Command("show a mixer's options", _cmd_info, _info_arguments),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2
        raise CliError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixer-plugins", description="Matrix mixers as pluggable PyTorch modules.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.version:
            import mixer_plugins

            print(mixer_plugins.__version__)
            return 0
        if args.command is None:
            parser.print_help()
            return 2
        return COMMANDS[args.command].run(args)
    except CliError as err:
        print(f"mixer-plugins: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
