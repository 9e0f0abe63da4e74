"""What ``mixer-plugins mlm`` and ``mixer-plugins lm`` share: fairseq2's recipe command line, read without fairseq2.

The arguments and the help are the recipes' own (:mod:`mixer_plugins.backbones.recipe_help`, which the ``python -m``
forms read too), so ``--help`` and argument errors answer at once; :func:`recipe_argv` gives the checked arguments
back as a command line, which :func:`run_recipe` hands to the recipe (:data:`MODULES`).
"""

from __future__ import annotations

import argparse
from typing import Literal

from ...backbones.recipe_help import OUT_DIR_REQUIRED, SUBCOMMANDS, add_recipe_arguments, recipe_help
from .args import CliError, Command

__all__ = ["MODULES", "recipe_argv", "recipe_command", "run_recipe"]

#: Recipe -> the module ``python -m`` runs for it.
MODULES = {"mlm": "mixer_plugins.backbones.fairseq2", "lm": "mixer_plugins.backbones.fairseq2.lm"}


def recipe_argv(args: argparse.Namespace) -> list[str]:
    """The recipe's command line from checked arguments (:class:`CliError` when ``OUT_DIR`` is missing, which only
    ``--dump-config`` may leave out)."""
    if not args.dump_config and not args.output_dir:
        raise CliError(OUT_DIR_REQUIRED)
    argv: list[str] = []
    if args.config_file is not None:
        argv += ["--config-file", str(args.config_file)]
    for items in args.config_overrides or []:
        argv += ["--config", *items]
    for flag in ("dump_config", "no_rich", "no_exit_on_error"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    if args.checkpoint_dir is not None:
        argv += ["--checkpoint-dir", str(args.checkpoint_dir)]
    if args.output_dir:
        argv += ["--", str(args.output_dir)]
    return argv


def run_recipe(recipe: Literal["mlm", "lm"], args: argparse.Namespace, prog: str) -> int:
    """Run ``recipe`` (:func:`mixer_plugins.backbones.fairseq2.__main__.run`) on ``args``, fairseq2 imported only
    now. fairseq2 exits the process itself when a run fails (one line for a bad config, status 2)."""
    from ...backbones.fairseq2.__main__ import run

    run(recipe, recipe_argv(args), prog)
    return 0


def recipe_command(recipe: Literal["mlm", "lm"], help_text: str) -> Command:
    """The ``mixer-plugins`` subcommand of ``recipe``: the recipe's arguments and help (naming the subcommands), run
    through :func:`run_recipe`."""
    description, epilog = recipe_help(recipe, SUBCOMMANDS)

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.description = description
        parser.epilog = epilog
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        add_recipe_arguments(parser)

    def run(args: argparse.Namespace) -> int:
        return run_recipe(recipe, args, prog=SUBCOMMANDS[recipe])

    return Command(help_text, run, add_arguments)
