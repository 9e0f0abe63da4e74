"""The ``mixer-plugins`` command line.

    mixer-plugins list               a table of every registered mixer (and any broken plugin)
    mixer-plugins info NAME          a mixer's options: type, default and help
    mixer-plugins demo               train small timm ViTs that differ only in the mixer, on scikit-learn's digits
    mixer-plugins bench              time, FLOPs and peak memory of mixers against sequence length (+ a log-log plot)
    mixer-plugins bench-table PATH   the comparison table of pytest-benchmark's saved JSON (benchmarks/ suites)
    mixer-plugins show NAME          heat map of a mixer's matrix for a random or given input
    mixer-plugins flops              analytic FLOPs of every mixer against PyTorch's FlopCounterMode
    mixer-plugins compare            train mixers on synthetic tasks (recall, copying, regression, digits) and compare

One module per subcommand (``list_mixers``, ``info``, ``demo``, ``bench``, ``bench_table``, ``show``, ``flops``,
``compare``), each exposing ``COMMAND``; :mod:`.main` holds the parser and :func:`main`, the console script.
Bad arguments exit with status 2 and a one-line reason on stderr.
"""

from __future__ import annotations

from .args import CliError, Command
from .main import COMMANDS, build_parser, main
from .options import parse_option_assignments, resolve_mixers, typed_option_value

__all__ = [
    "COMMANDS",
    "CliError",
    "Command",
    "build_parser",
    "main",
    "parse_option_assignments",
    "resolve_mixers",
    "typed_option_value",
]
