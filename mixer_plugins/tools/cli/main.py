"""The ``mixer-plugins`` parser and entry point: one subcommand per module of this package.

Bad arguments exit with status 2 and a one-line reason on stderr.

Start-up is cheap, and arguments are checked before torch is imported: this module imports none of the subcommand
modules, and a subcommand's module imports neither torch, pydantic nor timm until it runs. ``mixer-plugins --help``,
``--version``, ``list --names``, every subcommand's ``--help`` and every argument error answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ...errors import MixerError
from .args import CliError, Command, one_line

__all__ = ["COMMANDS", "EPILOG", "build_parser", "main"]

#: Subcommand -> (its module in this package, its help line), in the order ``--help`` lists them. The help line is
#: the module's ``COMMAND.help`` (a test keeps the two equal); it is repeated here so ``--help`` imports nothing.
_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "list": ("list_mixers", "list every registered mixer"),
    "info": ("info", "show a mixer's options"),
    "demo": ("demo", "train small timm ViTs that differ only in the mixer on scikit-learn's digits; "
                     "print a table and write learning curves and matrix heat maps"),
    "bench": ("bench", "time, FLOPs and peak memory of mixers against sequence length; table and log-log plot"),
    "bench-table": ("bench_table", "comparison table of pytest-benchmark's saved JSON (the benchmarks/ suites)"),
    "show": ("show", "heat map of a mixer's matrix for a random or given input"),
    "flops": ("flops", "analytic FLOPs of every mixer against PyTorch's FlopCounterMode"),
    "compare": ("compare", "train mixers on a synthetic task (several seeds) and compare them; presets check the "
                           "papers' orderings"),
    "env": ("env", "versions, devices and which kernel backends can run here (and why not)"),
    "mlm": ("mlm", "train a BERT-style encoder with any mixer by masked language modelling on fairseq2 (the fairseq2 "
                   "extra; also python -m mixer_plugins.backbones.fairseq2)"),
    "lm": ("lm", "train a decoder-only language model with any causal mixer on fairseq2 (the fairseq2 extra; also "
                 "python -m mixer_plugins.backbones.fairseq2.lm)"),
    "generate": ("generate", "generate text from a language-model checkpoint with fairseq2's sequence generators (the "
                             "fairseq2 extra; also python -m mixer_plugins.backbones.fairseq2.generate)"),
}

#: After the list of subcommands in ``mixer-plugins --help``: how to run the fairseq2 recipes.
EPILOG = """fairseq2 recipes and generation (pip install 'mixer-plugins[fairseq2]'; each has --help):
  mixer-plugins mlm OUT_DIR --config mixer.name=quasi          masked-LM training of an encoder
  mixer-plugins lm OUT_DIR --config mixer.name=semiseparable   causal-LM training of a decoder
  mixer-plugins generate OUT_DIR/checkpoints --prompt TEXT      text from the lm recipe's checkpoints
The same as python -m mixer_plugins.backbones.fairseq2 (mlm), ...fairseq2.lm and ...fairseq2.generate."""


class _Commands(dict[str, Command | None]):
    """The subcommands by name; a subcommand's module is imported the first time its :class:`Command` is read."""

    def __init__(self, modules: dict[str, tuple[str, str]]):
        super().__init__(dict.fromkeys(modules))
        self._modules = modules

    def __getitem__(self, name: str) -> Command:
        command = super().__getitem__(name)
        if command is None:
            command = importlib.import_module(f"{__package__}.{self._modules[name][0]}").COMMAND
            self[name] = command
        return command

    def help(self, name: str) -> str:
        """The help line of ``name`` without importing its module (unless it was replaced)."""
        command = super().__getitem__(name)
        return self._modules[name][1] if command is None else command.help


#: The subcommands, in the order ``--help`` lists them (modules imported on first use).
COMMANDS: _Commands = _Commands(_SUBCOMMANDS)

_ALL = object()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit status 2
        raise CliError(message)


def build_parser(only: str | None | object = _ALL) -> argparse.ArgumentParser:
    """The argument parser of the subcommands in :data:`COMMANDS`.

    By default every subcommand gets its full arguments (which imports every subcommand module). ``only`` gives
    the full arguments to that subcommand alone (``None``: to none); the others get their help line only, which
    is all ``mixer-plugins --help`` shows, so parsing imports only the subcommand that runs.
    """
    parser = _Parser(prog="mixer-plugins", description="Matrix mixers as pluggable PyTorch modules.", epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        if only is _ALL or name == only:
            cmd = COMMANDS[name]
            cmd.add_arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
        else:
            sub.add_parser(name, help=COMMANDS.help(name), description=COMMANDS.help(name))
    return parser


def _command_word(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line: the first word that is not an option (top-level options take
    no values)."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(only=_command_word(argv))
        args = parser.parse_args(argv)
        if args.version:
            from mixer_plugins import __version__  # the package root holds the version (and is cheap to import)

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
    except BrokenPipeError:  # the reader went away (``mixer-plugins list | head``): nothing left to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that Python's own flush at exit does not complain again
        return 0
