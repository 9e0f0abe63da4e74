"""``mixer-plugins generate CHECKPOINT_DIR --prompt TEXT``: text from a language-model recipe's checkpoint.

The command line of ``python -m mixer_plugins.backbones.fairseq2.generate``
(:mod:`mixer_plugins.backbones.fairseq2.generate`), with the same arguments and defaults (a test keeps them equal),
each checked here before fairseq2 (or torch) is imported: the values that module's ``GenerationSettings`` refuses are
argument errors.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .args import Command, non_negative_int, number_type, positive_int

__all__ = ["COMMAND", "MODULE"]

#: The module ``python -m`` runs for this command.
MODULE = "mixer_plugins.backbones.fairseq2.generate"

DESCRIPTION = ("Generate text from a mixer_decoder checkpoint (the language-model recipe's OUT_DIR/checkpoints, "
               "`mixer-plugins lm`) with fairseq2's sequence generators. Each prompt is encoded as <s> followed by "
               "its UTF-8 bytes, so an empty prompt is the single token <s>.")


_temperature = number_type(float, lambda v: math.isfinite(v) and v > 0, "a finite number above 0")
_top_p = number_type(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("checkpoint_dir", type=Path, help="the run's checkpoints folder (model.yaml, step_N/)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--step", type=non_negative_int, default=None, help="the step to load (default: the last)")
    parser.add_argument("--mode", choices=("sampling", "beam"), default="sampling",
                        help="top-k or top-p sampling, or beam search (default: sampling)")
    parser.add_argument("--max-gen-len", type=positive_int, default=64, help="most tokens to generate per prompt")
    parser.add_argument("--temperature", type=_temperature, default=0.8, help="sampling temperature")
    parser.add_argument("--top-k", type=positive_int, default=None, help="top-k sampling (default: top-p)")
    parser.add_argument("--top-p", type=_top_p, default=0.9, help="top-p (nucleus) sampling threshold")
    parser.add_argument("--beam-size", type=positive_int, default=4, help="hypotheses kept (beam search)")
    parser.add_argument("--num-gens", type=positive_int, default=1, help="samples per prompt (sampling)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling")


def generate_argv(args: argparse.Namespace) -> list[str]:
    """The command line of :data:`MODULE` for checked arguments (every value as ``--option=value``, so a prompt that
    starts with ``-`` stays a prompt)."""
    argv = [f"--prompt={prompt}" for prompt in args.prompt]
    if args.step is not None:
        argv.append(f"--step={args.step}")
    if args.top_k is not None:
        argv.append(f"--top-k={args.top_k}")
    for option in ("mode", "max_gen_len", "temperature", "top_p", "beam_size", "num_gens", "seed"):
        argv.append(f"--{option.replace('_', '-')}={getattr(args, option)}")
    return [*argv, "--", str(args.checkpoint_dir)]


def _run(args: argparse.Namespace) -> int:
    from ...backbones.fairseq2.generate import main

    return main(generate_argv(args))


COMMAND = Command("generate text from a language-model checkpoint with fairseq2's sequence generators (the "
                  f"fairseq2 extra; also python -m {MODULE})", _run, _add_arguments)
