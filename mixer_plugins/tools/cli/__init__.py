"""The ``mixer-plugins`` command line (``mixer-plugins --help`` lists the subcommands; ``docs/cli.md`` shows them).

One module per subcommand (``list_mixers``, ``info``, ``demo``, ``bench``, ``bench_table``, ``show``, ``flops``,
``compare``, ``env``, ``mlm``, ``lm``, ``generate``; the two recipes share :mod:`.recipes`), each exposing
``COMMAND``; :mod:`.main` holds the parser and :func:`main`, the console script. Bad arguments exit with status 2
and a one-line reason on stderr. Importing this package imports no subcommand module (and so neither torch nor
pydantic): ``--help`` and ``--version`` answer at once.
"""

from __future__ import annotations

from typing import Any

from .args import CliError, Command
from .main import COMMANDS, build_parser, main

_FROM_OPTIONS = ("parse_option_assignments", "resolve_mixers", "typed_option_value")


def __getattr__(name: str) -> Any:
    if name in _FROM_OPTIONS:  # .options imports the registry (torch, pydantic): only when asked for
        from . import options

        return getattr(options, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["COMMANDS", "CliError", "Command", "build_parser", "main", *_FROM_OPTIONS]
