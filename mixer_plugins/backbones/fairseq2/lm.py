"""``python -m mixer_plugins.backbones.fairseq2.lm OUT_DIR [--config key=value ...]``: the causal-language-model recipe.

The recipe is :class:`~mixer_plugins.backbones.fairseq2.recipe.MixerLmRecipe` (its names can be imported from here
too, loaded on first use); ``--help`` describes it and answers, as argument errors do, before fairseq2 is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..recipe_help import PYTHON_M, recipe_help

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .data import LmDataReader, TextDataSection, TokenBatch
    from .recipe import LossTrainUnit, MixerLmConfig, MixerLmRecipe

#: name -> the module of this package that defines it (imported on first access)
_LAZY = {"LmDataReader": "data", "TextDataSection": "data", "TokenBatch": "data", "LossTrainUnit": "recipe",
         "MixerLmConfig": "recipe", "MixerLmRecipe": "recipe"}

__all__ = ["LmDataReader", "LossTrainUnit", "MixerLmConfig", "MixerLmRecipe", "TextDataSection", "TokenBatch",
           "main"]

PROG = PYTHON_M["lm"]

DESCRIPTION, EPILOG = recipe_help("lm", PYTHON_M)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> None:
    """Run the recipe on ``argv`` (default: ``sys.argv[1:]``) with fairseq2's recipe command line and this recipe's
    help; ``prog`` is the command named in its messages (``mixer-plugins lm`` runs it through here)."""
    from .__main__ import run

    run("lm", argv, prog)


if __name__ == "__main__":
    main()
