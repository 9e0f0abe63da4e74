"""The help of the fairseq2 recipes, one text for both ways of running them: ``python -m
mixer_plugins.backbones.fairseq2[.lm]`` (which import fairseq2 first) and ``mixer-plugins mlm | lm`` (which answer
``--help`` without it). This module imports nothing heavy, so the command line reads it at once.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["PYTHON_M", "SUBCOMMANDS", "recipe_help"]

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
