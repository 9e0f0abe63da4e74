"""Generate text from a ``mixer_decoder`` checkpoint with fairseq2's own sequence generators.

    python -m mixer_plugins.backbones.fairseq2.generate OUT_DIR/checkpoints --prompt "The cat" --prompt "two plus"
    python -m mixer_plugins.backbones.fairseq2.generate OUT_DIR/checkpoints --prompt "The cat" --mode beam --beam-size 4

The checkpoint is reloaded through fairseq2's ``load_model`` with the config it was trained with
(:func:`~mixer_plugins.backbones.fairseq2.load_mixer_checkpoint`); prompts are encoded with the recipe's byte-level
tokenizer (``<s>`` then the bytes); generation is ``SamplingSequenceGenerator`` (top-k or top-p sampling) or
``BeamSearchSequenceGenerator``, whose incremental decoding runs on the mixers' caches. Only byte tokens and
``</s>`` can be generated. :func:`generate_text` is the same from Python, for a model already loaded.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # pragma: no cover - torch and fairseq2 are imported when used: --help answers without them
    from fairseq2.models.transformer_lm import TransformerLM
    from torch import Tensor

    from .corpus import ByteTokenizer

__all__ = ["GenerationSettings", "generate_text", "main"]


@dataclass(frozen=True)
class GenerationSettings:
    """How to generate: ``mode`` ``sampling`` (top-k when ``top_k`` is set, else top-p) or ``beam``."""

    mode: Literal["sampling", "beam"] = "sampling"
    max_gen_len: int = 64
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float = 0.9
    beam_size: int = 4
    num_gens: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in ("sampling", "beam"):
            problems.append(f"mode must be 'sampling' or 'beam', got {self.mode!r}")
        if self.max_gen_len < 1:
            problems.append(f"max_gen_len must be at least 1, got {self.max_gen_len}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            problems.append(f"temperature must be a finite number above 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"top_k must be at least 1 (leave it unset for top-p sampling), got {self.top_k}")
        if not 0 < self.top_p <= 1:   # (NaN fails)
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.beam_size < 1:
            problems.append(f"beam_size must be at least 1, got {self.beam_size}")
        if self.num_gens < 1:
            problems.append(f"num_gens must be at least 1, got {self.num_gens}")
        if problems:
            raise ValueError("; ".join(problems))


class _BytesOnly:
    """A step processor: only byte tokens and ``</s>`` may come next (no pad, mask, ``<s>`` or unused ids)."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tokenizer = tokenizer

    def __call__(self, seqs: Tensor, probs: Tensor, lprob: bool = False) -> None:
        import torch

        banned = torch.ones(probs.shape[-1], dtype=torch.bool, device=probs.device)
        banned[self._tokenizer.byte_offset:self._tokenizer.vocab_size] = False
        banned[self._tokenizer.eos_idx] = False
        probs.masked_fill_(banned, float("-inf") if lprob else 0.0)


def generate_text(model: TransformerLM, prompts: Sequence[str], settings: GenerationSettings = GenerationSettings()
                  ) -> list[list[str]]:
    """Continuations of each prompt (``num_gens`` with sampling, ``beam_size`` with beam search, best first)."""
    import torch
    from fairseq2.data.tokenizers import VocabularyInfo
    from fairseq2.generation import SequenceGenerator
    from fairseq2.generation.beam_search import BeamSearchSequenceGenerator, StandardBeamSearchAlgorithm
    from fairseq2.generation.sampling import SamplingSequenceGenerator, TopKSampler, TopPSampler
    from fairseq2.nn import BatchLayout

    from .corpus import ByteTokenizer
    from .data import pad_rows

    if not prompts:
        raise ValueError("give at least one prompt")
    tokenizer = ByteTokenizer()
    vocab = VocabularyInfo(size=model.final_proj.output_dim, unk_idx=None, bos_idx=tokenizer.bos_idx,
                           eos_idx=tokenizer.eos_idx, pad_idx=tokenizer.pad_idx)
    encoded = [[tokenizer.bos_idx] + [b + tokenizer.byte_offset for b in p.encode("utf-8")] for p in prompts]
    if max(len(e) for e in encoded) >= model.max_seq_len:
        raise ValueError(f"a prompt is longer than the model's max_seq_len={model.max_seq_len} tokens")
    tokens, seq_lens = pad_rows(encoded, tokenizer.pad_idx)
    tokens = tokens.to(next(model.parameters()).device)
    processors = [_BytesOnly(tokenizer)]
    generator: SequenceGenerator
    if settings.mode == "beam":
        generator = BeamSearchSequenceGenerator(
            model, vocab, StandardBeamSearchAlgorithm(), beam_size=settings.beam_size,
            max_gen_len=settings.max_gen_len, step_processors=processors)
    else:
        sampler = TopKSampler(settings.top_k) if settings.top_k is not None else TopPSampler(settings.top_p)
        generator = SamplingSequenceGenerator(
            model, vocab, sampler, num_gens=settings.num_gens, max_gen_len=settings.max_gen_len,
            temperature=settings.temperature, step_processors=processors)
    torch.manual_seed(settings.seed)
    with torch.no_grad():
        output = generator(tokens, BatchLayout.of(tokens, seq_lens))
    return [[tokenizer.decode(h.seq.tolist()).removesuffix("</s>") for h in hypotheses]
            for hypotheses in output.hypotheses]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mixer_plugins.backbones.fairseq2.generate",
        description="Generate text from a mixer_decoder checkpoint (the language-model recipe's "
                    "OUT_DIR/checkpoints) with fairseq2's sequence generators.")
    parser.add_argument("checkpoint_dir", type=Path, help="the run's checkpoints folder (model.yaml, step_N/)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--step", type=int, default=None, help="the step to load (default: the last)")
    parser.add_argument("--mode", choices=("sampling", "beam"), default="sampling")
    parser.add_argument("--max-gen-len", type=int, default=64, help="most tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling (default: top-p)")
    parser.add_argument("--top-p", type=float, default=0.9, help="top-p (nucleus) sampling threshold")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--num-gens", type=int, default=1, help="samples per prompt (sampling)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; prints each prompt followed by its continuations. Returns the exit status."""
    args = _parser().parse_args(argv)
    try:   # the options first, before fairseq2 is imported: a bad one answers at once
        settings = GenerationSettings(**{f.name: getattr(args, f.name) for f in fields(GenerationSettings)})
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("FAIRSEQ2_NO_PROGRESS", "1")
    from fairseq2.models.transformer_lm import TransformerLM

    from .checkpoint import load_mixer_checkpoint

    try:
        model = load_mixer_checkpoint(args.checkpoint_dir, step=args.step).eval()
        if not isinstance(model, TransformerLM):
            raise ValueError(f"{args.checkpoint_dir} holds a {type(model).__name__}, not a language model "
                             "(train one with python -m mixer_plugins.backbones.fairseq2.lm)")
        results = generate_text(model, args.prompt, settings)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for prompt, continuations in zip(args.prompt, results):
        for text in continuations:
            print(f"{prompt}{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
