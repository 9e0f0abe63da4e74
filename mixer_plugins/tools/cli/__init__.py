"""The ``mixer-plugins`` command line.

    mixer-plugins list               a table of every registered mixer (and any broken plugin)
    mixer-plugins info NAME          a mixer's options: type, default and help
    mixer-plugins demo               train small timm ViTs that differ only in the mixer, on scikit-learn's digits
    mixer-plugins bench              time, FLOPs and peak memory of mixers against sequence length (+ a log-log plot)
    mixer-plugins bench-table PATH   the comparison table of pytest-benchmark's saved JSON (benchmarks/ suites)
    mixer-plugins show NAME          heat map of a mixer's matrix for a random or given input
    mixer-plugins flops              analytic FLOPs of every mixer against PyTorch's FlopCounterMode
    mixer-plugins compare            train mixers on synthetic tasks (recall, copying, regression, digits) and compare
    mixer-plugins env                versions, devices and which kernel backends can run here (and why not)
    mixer-plugins mlm OUT_DIR        fairseq2's masked-LM recipe (python -m mixer_plugins.backbones.fairseq2)
    mixer-plugins lm OUT_DIR         fairseq2's causal-LM recipe (python -m mixer_plugins.backbones.fairseq2.lm)
    mixer-plugins generate CKPT_DIR  text from an lm checkpoint (python -m mixer_plugins.backbones.fairseq2.generate)

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
