"""``mixer-plugins mlm OUT_DIR [--config NAME=VALUE ...]``: the fairseq2 masked-language-model recipe.

The recipe of ``python -m mixer_plugins.backbones.fairseq2`` (:mod:`mixer_plugins.backbones.fairseq2.recipe`), its
arguments checked before fairseq2 is imported (:mod:`.recipes`). ``DESCRIPTION`` and ``EPILOG`` are that module's,
naming this command (a test keeps them equal).
"""

from __future__ import annotations

import argparse

from .args import Command
from .recipes import MODULES, add_recipe_arguments, run_recipe

__all__ = ["COMMAND", "DESCRIPTION", "EPILOG"]

DESCRIPTION = """\
Train a BERT-style encoder (the mixer_encoder model family) whose token mixer is any registered mixer, with masked
language modelling, on fairseq2's recipe machinery. CPU is fine and nothing is downloaded: it trains on a small
generated corpus (or on data.text_file, one example per line) with a byte-level tokenizer and BERT masking
(15 %: 80 % <mask>, 10 % random byte, 10 % unchanged).

OUT_DIR receives config.yaml, the logs, metrics/train.jsonl and checkpoints/ (step_N/ and model.yaml, which
fairseq2's load_model reads back; see mixer_plugins.backbones.fairseq2.load_mixer_checkpoint). A folder whose
checkpoints belong to another model config (e.g. another mixer) is refused before anything is written, unless
--config overwrite_checkpoints=true (which deletes them).

Choosing the mixer (any name or alias of `mixer-plugins list`; its options: `mixer-plugins info NAME`):
  --config mixer.name=NAME                  the mixer (null, the default: the arch's own mixer)
  --config mixer.options.OPTION=VALUE       one of its options (the model supplies dim, num_heads, max_seq_len)
The same fields are model.config_overrides.mixer and model.config_overrides.mixer_options.NAME.OPTION.
Archs (model.arch): tiny (default, 32 wide), small (256), base (BERT-base), base_hydra (Hydra BERT: 23 layers
of quasiseparable, no FFN). Other model fields: model.config_overrides.FIELD (model_dim, num_layers, ...)."""

EPILOG = """\
examples:
  mixer-plugins mlm OUT --config mixer.name=quasi
  mixer-plugins mlm OUT --config mixer.name=quasi mixer.options.d_state=32 \\
      regime.num_steps=200 model.arch=small
  mixer-plugins mlm --dump-config --config mixer.name=toeplitz   # every option, as YAML

Defaults that differ from fairseq2's: trainer.mixed_precision.mode=off (on a GPU pass =auto for bf16 autocast),
common.no_sweep_dir=true (outputs directly in OUT_DIR), trainer.max_grad_norm=1.0."""

HELP = ("train a BERT-style encoder with any mixer by masked language modelling on fairseq2 (the fairseq2 extra; "
        f"also python -m {MODULES['mlm']})")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_recipe_arguments(parser)


def _run(args: argparse.Namespace) -> int:
    return run_recipe("mlm", args, prog="mixer-plugins mlm")


COMMAND = Command(HELP, _run, _add_arguments)
