"""``python -m mixer_plugins.backbones.fairseq2 OUT_DIR [--config key=value ...]``: the MLM recipe.

See :mod:`mixer_plugins.backbones.fairseq2.recipe`; ``--help`` describes it, ``--dump-config`` prints every option.
``--help`` and argument errors answer before fairseq2 is imported. :func:`run` runs either recipe (``.lm`` and
``mixer-plugins mlm | lm`` run them through it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import re
import sys
from collections.abc import Iterator, Sequence

from ..recipe_help import PYTHON_M, Recipe, parse_recipe_arguments, recipe_help

PROG = PYTHON_M["mlm"]

DESCRIPTION, EPILOG = recipe_help("mlm", PYTHON_M)


def config_error_line(error: BaseException) -> str:
    """One line for a recipe config that cannot be read: the messages of the error's causes, most specific last,
    without the generic wrappers fairseq2 adds around them."""
    messages = []
    seen = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = re.sub(r"<class '(?:[\w]+\.)*(\w+)'>", r"\1", " ".join(str(current).split()))
        if text and not text.startswith(("Recipe configuration cannot be", "Value cannot be structured to")):
            messages.append(text.rstrip("."))
        current = current.__cause__ or current.__context__
    return "the recipe configuration is not valid: " + (": ".join(messages) or "it cannot be parsed")


class _OneLineConfigErrors(logging.Filter):
    """fairseq2 logs a config that cannot be structured (unknown keys, values of the wrong type) with its stack trace;
    a user's typo deserves one line. Rewrites that one record (the exit status stays fairseq2's, 2)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from fairseq2.recipe.error import RecipeConfigParseError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, RecipeConfigParseError):
            record.msg, record.args = config_error_line(error), ()
            record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def recipe_command_line(recipe: Recipe, argv: Sequence[str] | None, prog: str) -> Iterator[None]:
    """What fairseq2's recipe command line (``fairseq2.recipe.cli``) reads, for the duration of a run: ``sys.argv``
    holds ``prog`` and ``argv`` (unchanged when ``argv`` is None); its bare ``ArgumentParser`` names ``prog`` and
    carries ``recipe``'s help, as :func:`~mixer_plugins.backbones.recipe_help.parse_recipe_arguments` does (which
    answers ``--help`` and argument errors first); and a config that cannot be read is logged in one line."""
    from fairseq2.recipe import cli

    description, epilog = recipe_help(recipe, PYTHON_M)
    original_argv, original_parser = sys.argv, getattr(cli, "ArgumentParser", None)
    one_line = _OneLineConfigErrors()
    if argv is not None:
        sys.argv = [prog, *argv]
    if original_parser is argparse.ArgumentParser:  # fairseq2's cli module refers to the class it imported
        cli.ArgumentParser = functools.partial(  # type: ignore[misc, assignment]
            argparse.ArgumentParser, prog=prog, description=description, epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter)
    logging.getLogger("fairseq2").addFilter(one_line)
    try:
        yield
    finally:
        logging.getLogger("fairseq2").removeFilter(one_line)
        if original_parser is argparse.ArgumentParser:
            cli.ArgumentParser = original_parser  # type: ignore[misc]
        sys.argv = original_argv


def run(recipe: Recipe, argv: Sequence[str] | None, prog: str) -> None:
    """Run ``recipe`` on ``argv`` (default: ``sys.argv[1:]``) with fairseq2's recipe command line and the recipe's
    help; ``prog`` is the command named in its messages."""
    parse_recipe_arguments(recipe, argv, prog)  # --help and argument errors exit here, before fairseq2 is imported
    from fairseq2.recipe import main as recipe_main

    from .recipe import MixerLmRecipe, MixerMlmRecipe

    with recipe_command_line(recipe, argv, prog):
        recipe_main(MixerMlmRecipe() if recipe == "mlm" else MixerLmRecipe())


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> None:
    """Run the MLM recipe (``mixer-plugins mlm`` runs it through :func:`run`, naming itself in ``prog``)."""
    run("mlm", argv, prog)


if __name__ == "__main__":
    main()
