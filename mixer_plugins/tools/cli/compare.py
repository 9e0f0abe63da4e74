"""``mixer-plugins compare``: synthetic tasks over any registered mixers (see :mod:`mixer_plugins.tools.compare`)."""

from __future__ import annotations

import argparse

from .args import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..compare.cli import EPILOG, configure_parser

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    configure_parser(parser)


def _run(args: argparse.Namespace) -> int:
    from ..compare.cli import run_compare

    return run_compare(args)


COMMAND = Command(help="train mixers on a synthetic task (several seeds) and compare them; presets check the papers'"
                       " orderings", run=_run, add_arguments=_add_arguments)
