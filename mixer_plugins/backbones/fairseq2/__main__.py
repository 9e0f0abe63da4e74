"""``python -m mixer_plugins.backbones.fairseq2 OUT_DIR [--config key=value ...]``: the MLM recipe.

See :mod:`mixer_plugins.backbones.fairseq2.recipe`; ``--help`` describes it, ``--dump-config`` prints every option.
``--help`` and argument errors answer before fairseq2 is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import re
import sys
from collections.abc import Iterator, Sequence

from ..recipe_help import PYTHON_M, parse_recipe_arguments, recipe_help

PROG = PYTHON_M["mlm"]

DESCRIPTION, EPILOG = recipe_help("mlm", PYTHON_M)


@contextlib.contextmanager
def described_parser(prog: str = PROG, description: str = DESCRIPTION, epilog: str = EPILOG) -> Iterator[None]:
    """Make fairseq2's recipe command line (``fairseq2.recipe.cli``, which builds a bare ``ArgumentParser``) name
    a recipe's command and carry its description and examples (by default this one's), as the parser of
    :func:`~mixer_plugins.backbones.recipe_help.parse_recipe_arguments` does, which answers ``--help`` and argument
    errors first. A fairseq2 without that module attribute keeps its own parser (a test notices)."""
    from fairseq2.recipe import cli

    original = getattr(cli, "ArgumentParser", None)
    if original is not argparse.ArgumentParser:
        yield
        return
    # fairseq2's cli module refers to the class it imported; a factory stands in for it while the context lasts
    cli.ArgumentParser = functools.partial(  # type: ignore[misc, assignment]
        argparse.ArgumentParser, prog=prog, description=description, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        yield
    finally:
        cli.ArgumentParser = original  # type: ignore[misc]


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
def one_line_config_errors() -> Iterator[None]:
    """Install :class:`_OneLineConfigErrors` on fairseq2's logger for the duration of a run."""
    logger = logging.getLogger("fairseq2")
    one_line = _OneLineConfigErrors()
    logger.addFilter(one_line)
    try:
        yield
    finally:
        logger.removeFilter(one_line)


@contextlib.contextmanager
def command_line(argv: Sequence[str] | None, prog: str) -> Iterator[None]:
    """fairseq2's recipe command line reads ``sys.argv``: within the block it holds ``prog`` and ``argv`` (unchanged
    when ``argv`` is None)."""
    if argv is None:
        yield
        return
    original = sys.argv
    sys.argv = [prog, *argv]
    try:
        yield
    finally:
        sys.argv = original


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> None:
    """Run the recipe on ``argv`` (default: ``sys.argv[1:]``) with fairseq2's recipe command line and this recipe's
    help; ``prog`` is the command named in its messages (``mixer-plugins mlm`` runs it through here)."""
    parse_recipe_arguments("mlm", argv, prog)  # --help and argument errors exit here, before fairseq2 is imported
    from fairseq2.recipe import main as recipe_main

    from .recipe import MixerMlmRecipe

    with command_line(argv, prog), described_parser(prog), one_line_config_errors():
        recipe_main(MixerMlmRecipe())


if __name__ == "__main__":
    main()
