"""``mixer-plugins compare``: synthetic tasks over any registered mixers (see :mod:`mixer_plugins.tools.compare`)."""

from __future__ import annotations

from ..compare.cli import configure_parser, run_compare
from .args import Command

COMMAND = Command(help="train mixers on a synthetic task (several seeds) and compare them; presets check the papers'"
                       " orderings", run=run_compare, add_arguments=configure_parser)
