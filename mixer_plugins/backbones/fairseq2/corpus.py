"""The MLM recipe's data: a byte-level tokenizer and a small corpus generated on the fly (no downloads).

The generated corpus is English-like text from a small grammar with a fixed seed: simple clauses, clauses
joined by "because"/"and then", and arithmetic facts spelled in words ("three plus four makes seven."). It is
tiny, deterministic and has structure an MLM can learn at both ends of a masked span (spelling, agreement,
the sum of two numbers), so a few hundred CPU steps show a clearly falling loss. Users can train on their own
text file instead (one example per line).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

__all__ = ["ByteTokenizer", "encode_all", "generate_corpus", "read_text_file"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``pad=0, mask=1, bos=2, eos=3``, byte ``b`` is ``b + 4``; 260 ids in all."""

    pad_idx: Final = 0
    mask_idx: Final = 1
    bos_idx: Final = 2
    eos_idx: Final = 3
    byte_offset: Final = 4
    vocab_size: Final = 256 + 4

    def encode(self, text: str, max_len: int) -> list[int]:
        """``[bos] + bytes + [eos]``, the bytes truncated so the whole fits in ``max_len`` (>= 3) tokens."""
        if max_len < 3:
            raise ValueError(f"max_len must be >= 3 (bos, one byte, eos), got {max_len}")
        data = text.encode("utf-8")[: max_len - 2]
        return [self.bos_idx] + [b + self.byte_offset for b in data] + [self.eos_idx]

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special tokens are shown as ``<pad>``, ``<mask>``, ``<s>``, ``</s>``."""
        names = {self.pad_idx: "<pad>", self.mask_idx: "<mask>", self.bos_idx: "<s>", self.eos_idx: "</s>"}
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if i >= self.byte_offset:
                pending.append(i - self.byte_offset)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
            out.append(names.get(i, f"<{i}>"))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]
_SUBJECTS = ["the cat", "a dog", "the old sailor", "my sister", "the small robot", "a curious child",
             "the teacher", "our neighbour", "the baker", "a tired farmer", "the young pilot", "her brother"]
_VERBS = ["sees", "finds", "likes", "paints", "follows", "builds", "reads", "carries", "draws", "hides",
          "washes", "sells"]
_OBJECTS = ["a red ball", "the blue house", "an old map", "the quiet river", "a wooden boat", "the tall tree",
            "a strange letter", "the green door", "a heavy box", "the broken clock", "a bright lamp",
            "the silver key"]
_ADVERBIALS = ["in the morning", "near the lake", "after lunch", "at night", "under the bridge", "every day",
               "before the rain", "in the garden", "on sunday", "with great care"]
_REASONS = ["it is late", "the sun is warm", "the road is long", "nobody is home", "the wind is cold"]


def _clause(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ADVERBIALS)}"


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return f"{_clause(rng)}."
    if kind < 0.55:
        return f"{_clause(rng)} because {rng.choice(_REASONS)}."
    if kind < 0.7:
        return f"{_clause(rng)}, and then {_clause(rng)}."
    a, b = rng.randrange(10), rng.randrange(9)
    return f"{_NUMBERS[a]} plus {_NUMBERS[b]} makes {_NUMBERS[a + b]}."


def generate_corpus(num_examples: int, *, seed: int = 0) -> list[str]:
    """``num_examples`` short texts of one to three sentences, the same for the same seed."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    rng = random.Random(seed)
    texts = []
    for _ in range(num_examples):
        sentences = [_sentence(rng) for _ in range(rng.choice((1, 1, 2, 3)))]
        text = " ".join(sentences)
        texts.append(text[0].upper() + text[1:])
    return texts


def read_text_file(path: Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file, one example each."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"data.text_file {str(path)!r} does not exist") from None
    texts = [line.strip() for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"data.text_file {str(path)!r} has no non-empty line to train on")
    return texts


def encode_all(tokenizer: ByteTokenizer, texts: Sequence[str], max_len: int) -> list[list[int]]:
    """Encode every text (each truncated to ``max_len`` tokens)."""
    return [tokenizer.encode(t, max_len) for t in texts]
