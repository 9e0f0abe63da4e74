"""``python -m mixer_plugins.backbones.fairseq2 OUT_DIR [--config key=value ...]``: the MLM recipe.

See :mod:`mixer_plugins.backbones.fairseq2.recipe`; ``--dump-config`` prints every option.
"""

from fairseq2.recipe import main

from .recipe import MixerMlmRecipe

if __name__ == "__main__":
    main(MixerMlmRecipe())
