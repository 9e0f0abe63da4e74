"""What ``mixer-plugins mlm`` and ``mixer-plugins lm`` share: fairseq2's recipe command line, read without fairseq2.

fairseq2's recipe command line (``fairseq2.recipe.cli``) parses its arguments only after fairseq2 is imported, which
takes seconds. :func:`add_recipe_arguments` declares the same arguments (a test keeps the two equal), so ``--help``
and argument errors answer at once; :func:`recipe_argv` gives the checked arguments back as a command line, which
:func:`run_recipe` hands to the recipe (:data:`MODULES`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

from ...backbones.recipe_help import SUBCOMMANDS, recipe_help
from .args import CliError, Command

__all__ = ["MODULES", "add_recipe_arguments", "config_item", "recipe_argv", "recipe_command", "run_recipe"]

#: Recipe -> the module ``python -m`` runs for it.
MODULES = {"mlm": "mixer_plugins.backbones.fairseq2", "lm": "mixer_plugins.backbones.fairseq2.lm"}


def config_item(text: str) -> str:
    """One ``--config`` item as fairseq2 reads it: ``NAME=VALUE`` (``VALUE`` in YAML; ``set:NAME=VALUE`` too) or
    ``del:NAME``. Returned unchanged; argparse reports a malformed one in one line."""
    item = text.strip()
    if item.startswith("del:"):
        if "=" in item:
            raise argparse.ArgumentTypeError(f"key should not contain '=': {text!r} (del:NAME removes a field)")
        return text
    name, equals, value = item.partition("=")
    if not equals or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. mixer.name=quasi), got {text!r}")
    try:  # fairseq2's YAML reader (installed with the fairseq2 extra)
        from ruamel.yaml import YAML
        from ruamel.yaml.error import YAMLError
    except ImportError:  # pragma: no cover - without the extra the recipe itself says what to install
        return text
    try:
        YAML(typ="safe", pure=True).load(value.lstrip())
    except YAMLError:
        raise argparse.ArgumentTypeError(f"invalid key-value pair: {text!r} (the value must be YAML)") from None
    return text


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of fairseq2's recipe command line, with the same names, defaults and meaning."""
    parser.add_argument("--config-file", dest="config_file", metavar="CONFIG_FILE", type=Path, nargs="?",
                        help="configuration file")
    parser.add_argument("--config", dest="config_overrides", metavar="NAME=VALUE", type=config_item, nargs="*",
                        action="append", help="command line configuration overrides (VALUE in YAML)")
    parser.add_argument("--dump-config", action="store_true",
                        help="dump the configuration in mergeable format to standard output")
    parser.add_argument("--no-rich", default=False, action="store_true",
                        help="whether to disable rich text output for logging")
    parser.add_argument("--no-exit-on-error", default=False, action="store_true",
                        help="whether to propagate unhandled errors")
    parser.add_argument("output_dir", type=Path, nargs="?", metavar="OUT_DIR",
                        help="directory to store recipe artifacts")
    parser.add_argument("--checkpoint-dir", dest="checkpoint_dir", metavar="CHECKPOINT_DIR", type=Path, default=None,
                        help="directory to store checkpoints (default: OUT_DIR/checkpoints)")


def recipe_argv(args: argparse.Namespace) -> list[str]:
    """The recipe's command line from checked arguments (:class:`CliError` when ``OUT_DIR`` is missing, which only
    ``--dump-config`` may leave out)."""
    if not args.dump_config and not args.output_dir:
        raise CliError("the following arguments are required: OUT_DIR (or --dump-config)")
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
    """Run ``recipe`` (the ``main`` of its module in :data:`MODULES`) on ``args``, fairseq2 imported only now.
    fairseq2 exits the process itself when a run fails (one line for a bad config, status 2)."""
    argv = recipe_argv(args)
    if recipe == "mlm":
        from ...backbones.fairseq2.__main__ import main
    else:
        from ...backbones.fairseq2.lm import main
    main(argv, prog=prog)
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
