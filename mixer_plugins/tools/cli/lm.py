"""``mixer-plugins lm OUT_DIR [--config NAME=VALUE ...]``: the fairseq2 causal-language-model recipe.

The recipe of ``python -m mixer_plugins.backbones.fairseq2.lm`` (:mod:`mixer_plugins.backbones.fairseq2.lm`), its
arguments checked before fairseq2 is imported (:mod:`.recipes`). ``DESCRIPTION`` and ``EPILOG`` are that module's,
naming these commands (a test keeps them equal).
"""

from __future__ import annotations

import argparse

from .args import Command
from .recipes import MODULES, add_recipe_arguments, run_recipe

__all__ = ["COMMAND", "DESCRIPTION", "EPILOG"]

DESCRIPTION = """\
Train a decoder-only language model (the mixer_decoder model family) whose token mixer is any causal mixer, on
next-token prediction, on fairseq2's recipe machinery. CPU is fine and nothing is downloaded: it trains on a small
generated corpus (or on data.text_file, one example per line) with a byte-level tokenizer.

OUT_DIR receives config.yaml, the logs, metrics/train.jsonl and checkpoints/; generate text from them with
mixer-plugins generate OUT_DIR/checkpoints --prompt TEXT.

Choosing the mixer (any name or alias of `mixer-plugins list` with a causal form):
  --config mixer.name=NAME                  the mixer (null, the default: the arch's own, attention)
  --config mixer.options.OPTION=VALUE       one of its options (the model supplies dim, num_heads, max_seq_len,
                                            causal=true)
Archs (model.arch): tiny (default, 32 wide), small (256), base (GPT-2 small's shape)."""

EPILOG = """\
examples:
  mixer-plugins lm OUT --config mixer.name=semiseparable
  mixer-plugins lm OUT --config mixer.name=sliding_window_attention \\
      mixer.options.window=32 model.arch=small regime.num_steps=2000"""

HELP = ("train a decoder-only language model with any causal mixer on fairseq2 (the fairseq2 extra; also "
        f"python -m {MODULES['lm']})")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_recipe_arguments(parser)


def _run(args: argparse.Namespace) -> int:
    return run_recipe("lm", args, prog="mixer-plugins lm")


COMMAND = Command(HELP, _run, _add_arguments)
