"""``python -m mixer_plugins.backbones.fairseq2.lm OUT_DIR [--config key=value ...]``: the causal-language-model recipe.

The recipe is :mod:`~mixer_plugins.backbones.fairseq2.lm_recipe` (its names can be imported from here too, loaded on
first use); ``--help`` describes it and answers, as argument errors do, before fairseq2 is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..recipe_help import PYTHON_M, parse_recipe_arguments, recipe_help

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .lm_recipe import LmBatch, LmDataReader, LmDataSection, LmTrainUnit, MixerLmConfig, MixerLmRecipe

__all__ = ["LmBatch", "LmDataReader", "LmDataSection", "LmTrainUnit", "MixerLmConfig", "MixerLmRecipe", "main"]

PROG = PYTHON_M["lm"]

DESCRIPTION, EPILOG = recipe_help("lm", PYTHON_M)


def __getattr__(name: str) -> Any:
    if name in __all__:  # the recipe's names (main is defined here)
        return getattr(importlib.import_module(".lm_recipe", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> None:
    """Run the recipe on ``argv`` (default: ``sys.argv[1:]``) with fairseq2's recipe command line and this recipe's
    help; ``prog`` is the command named in its messages (``mixer-plugins lm`` runs it through here)."""
    parse_recipe_arguments("lm", argv, prog)  # --help and argument errors exit here, before fairseq2 is imported
    from fairseq2.recipe import main as recipe_main

    from .__main__ import command_line, described_parser, one_line_config_errors
    from .lm_recipe import MixerLmRecipe

    with command_line(argv, prog), described_parser(prog, DESCRIPTION, EPILOG), one_line_config_errors():
        recipe_main(MixerLmRecipe())


if __name__ == "__main__":
    main()
