"""``mixer-plugins lm OUT_DIR [--config NAME=VALUE ...]``: the fairseq2 causal-language-model recipe.

The recipe of ``python -m mixer_plugins.backbones.fairseq2.lm`` (:mod:`mixer_plugins.backbones.fairseq2.lm`), its
arguments checked before fairseq2 is imported (:mod:`.recipes`); its help is the recipe's
(:mod:`mixer_plugins.backbones.recipe_help`), naming these commands.
"""

from __future__ import annotations

from ...backbones.recipe_help import SUBCOMMANDS, recipe_help
from .recipes import MODULES, recipe_command

__all__ = ["COMMAND", "DESCRIPTION", "EPILOG"]

DESCRIPTION, EPILOG = recipe_help("lm", SUBCOMMANDS)

COMMAND = recipe_command("lm", "train a decoder-only language model with any causal mixer on fairseq2 (the fairseq2 "
                               f"extra; also python -m {MODULES['lm']})")
