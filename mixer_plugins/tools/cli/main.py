"""The ``mixer-plugins`` parser and entry point: one subcommand per module of this package.

Bad arguments exit with status 2 and a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ...errors import MixerError
from . import bench, bench_table, compare, demo, flops, info, list_mixers, show
from .args import CliError, Command, one_line

__all__ = ["COMMANDS", "build_parser", "main"]

#: The subcommands, in the order ``--help`` lists them.
COMMANDS: dict[str, Command] = {
    "list": list_mixers.COMMAND,
    "info": info.COMMAND,
    "demo": demo.COMMAND,
    "bench": bench.COMMAND,
    "bench-table": bench_table.COMMAND,
    "show": show.COMMAND,
    "flops": flops.COMMAND,
    "compare": compare.COMMAND,
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2
        raise CliError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand in :data:`COMMANDS`."""
    parser = _Parser(prog="mixer-plugins", description="Matrix mixers as pluggable PyTorch modules.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in COMMANDS.items():
        cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.version:
            from mixer_plugins import __version__  # the package root holds the version

            print(__version__)
            return 0
        if args.command is None:
            parser.print_help()
            return 2
        return COMMANDS[args.command].run(args)
    except (CliError, MixerError) as err:
        # MixerError: bad names, options, lengths, inputs or a missing extra, all the user's to fix.
        print(f"mixer-plugins: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        return 130
