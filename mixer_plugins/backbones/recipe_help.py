"""The command line of the fairseq2 recipes, read without fairseq2: one help text and one set of arguments for both
ways of running them, ``python -m mixer_plugins.backbones.fairseq2[.lm]`` and ``mixer-plugins mlm | lm``.

fairseq2's recipe command line (``fairseq2.recipe.cli``) parses its arguments only after fairseq2 is imported, which
takes seconds. :func:`add_recipe_arguments` declares the same arguments (a test keeps them equal), so ``--help`` and
argument errors answer at once; fairseq2 then reads the checked command line again. This module imports nothing
heavy.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

__all__ = ["OUT_DIR_REQUIRED", "PYTHON_M", "SUBCOMMANDS", "add_recipe_arguments", "config_item",
           "parse_recipe_arguments", "recipe_help"]

Recipe = Literal["mlm", "lm"]

#: How each command is run as a module, and as a ``mixer-plugins`` subcommand.
PYTHON_M = {"mlm": "python -m mixer_plugins.backbones.fairseq2", "lm": "python -m mixer_plugins.backbones.fairseq2.lm",
            "generate": "python -m mixer_plugins.backbones.fairseq2.generate"}
SUBCOMMANDS = {"mlm": "mixer-plugins mlm", "lm": "mixer-plugins lm", "generate": "mixer-plugins generate"}

_DESCRIPTIONS: dict[str, str] = {
    "mlm": """\
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
of quasiseparable, no FFN). Other model fields: model.config_overrides.FIELD (model_dim, num_layers, ...).""",
    "lm": """\
Train a decoder-only language model (the mixer_decoder model family) whose token mixer is any causal mixer, on
next-token prediction, on fairseq2's recipe machinery. CPU is fine and nothing is downloaded: it trains on a small
generated corpus (or on data.text_file, one example per line) with a byte-level tokenizer.

OUT_DIR receives config.yaml, the logs, metrics/train.jsonl and checkpoints/; generate text from them with
{generate} OUT_DIR/checkpoints --prompt TEXT.

Choosing the mixer (any name or alias of `mixer-plugins list` with a causal form):
  --config mixer.name=NAME                  the mixer (null, the default: the arch's own, attention)
  --config mixer.options.OPTION=VALUE       one of its options (the model supplies dim, num_heads, max_seq_len,
                                            causal=true)
Archs (model.arch): tiny (default, 32 wide), small (256), base (GPT-2 small's shape).""",
}

_EPILOGS: dict[str, str] = {
    "mlm": """\
examples:
  {mlm} OUT --config mixer.name=quasi
  {mlm} OUT --config mixer.name=quasi mixer.options.d_state=32 \\
      regime.num_steps=200 model.arch=small
  {mlm} --dump-config --config mixer.name=toeplitz   # every option, as YAML

Defaults that differ from fairseq2's: trainer.mixed_precision.mode=off (on a GPU pass =auto for bf16 autocast),
common.no_sweep_dir=true (outputs directly in OUT_DIR), trainer.max_grad_norm=1.0.""",
    "lm": """\
examples:
  {lm} OUT --config mixer.name=semiseparable
  {lm} OUT --config mixer.name=sliding_window_attention \\
      mixer.options.window=32 model.arch=small regime.num_steps=2000""",
}


def recipe_help(recipe: Recipe, commands: dict[str, str]) -> tuple[str, str]:
    """The description and the examples of ``recipe``'s ``--help``, naming the commands as ``commands`` does
    (:data:`PYTHON_M` or :data:`SUBCOMMANDS`)."""
    return _DESCRIPTIONS[recipe].format(**commands), _EPILOGS[recipe].format(**commands)


#: What a recipe's command line without ``OUT_DIR`` is told (only ``--dump-config`` may leave it out).
OUT_DIR_REQUIRED = "the following arguments are required: OUT_DIR (or --dump-config)"


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


def parse_recipe_arguments(recipe: Recipe, argv: Sequence[str] | None, prog: str) -> argparse.Namespace:
    """Read ``argv`` (default: ``sys.argv[1:]``) as ``python -m`` runs ``recipe``, before fairseq2 is imported:
    ``--help`` prints the recipe's help and an argument error its usage and one line, both exiting there (status 0
    and 2). ``prog`` is the command named in them."""
    description, epilog = recipe_help(recipe, PYTHON_M)
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recipe_arguments(parser)
    args = parser.parse_args(argv)
    if not args.dump_config and not args.output_dir:
        parser.error(OUT_DIR_REQUIRED)
    return args
