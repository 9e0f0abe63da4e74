"""``mixer-plugins mlm OUT_DIR [--config NAME=VALUE ...]``: the fairseq2 masked-language-model recipe.

The recipe of ``python -m mixer_plugins.backbones.fairseq2`` (:mod:`mixer_plugins.backbones.fairseq2.recipe`), its
arguments checked before fairseq2 is imported (:mod:`.recipes`); its help is the recipe's
(:mod:`mixer_plugins.backbones.recipe_help`), naming this command.
"""

from __future__ import annotations

from ...backbones.recipe_help import SUBCOMMANDS, recipe_help
from .recipes import MODULES, recipe_command

__all__ = ["COMMAND", "DESCRIPTION", "EPILOG"]

DESCRIPTION, EPILOG = recipe_help("mlm", SUBCOMMANDS)

COMMAND = recipe_command("mlm", "train a BERT-style encoder with any mixer by masked language modelling on fairseq2 "
                                f"(the fairseq2 extra; also python -m {MODULES['mlm']})")
