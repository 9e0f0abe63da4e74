"""The recipes' batches: a deterministic, resumable data reader of shuffled examples, the MLM recipe's BERT-style
masking of byte tokens and the LM recipe's next-token targets.

Kept apart from the recipe itself so it can be used (and tested) without importing fairseq2's recipe stack.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import final

import torch
from fairseq2.datasets import DataReader, SequenceBatch
from fairseq2.device import Device, SupportsDeviceTransfer
from fairseq2.nn import BatchLayout
from fairseq2.utils.validation import ValidationResult
from torch import Tensor
from typing_extensions import Self, override

from .corpus import ByteTokenizer

__all__ = ["EpochReader", "LmDataReader", "MlmDataReader", "MlmDataSection", "TextDataSection", "TokenBatch",
           "mask_tokens", "pad_rows"]


@dataclass(kw_only=True)
class TextDataSection:
    """The ``data`` fields both recipes share: the corpus, the batch size and the shuffling seed."""

    text_file: Path | None = None
    """A UTF-8 text file, one example per line; ``None``: the generated corpus."""

    num_examples: int = 4000
    """Size of the generated corpus (ignored with ``text_file``)."""

    corpus_seed: int = 0
    """Seed of the generated corpus."""

    max_seq_len: int = 96
    """Tokens per example, including the ``<s>`` and ``</s>`` tokens (longer texts are truncated)."""

    batch_size: int = 16
    """Examples per batch per data-parallel rank: the global batch (``batch_size * ranks`` examples, the same ones
    for any number of ranks) is split between the ranks."""

    seed: int = 0
    """Seed of the shuffling and of the MLM masking (batch ``k`` of epoch ``e`` is the same on every run)."""

    def validate(self) -> ValidationResult:
        result = ValidationResult()
        if self.num_examples < 1:
            result.add_error(f"`num_examples` must be >= 1, but is {self.num_examples}.")
        if self.max_seq_len < 3:
            result.add_error(f"`max_seq_len` must be >= 3 (<s>, a byte, </s>), but is {self.max_seq_len}.")
        if self.batch_size < 1:
            result.add_error(f"`batch_size` must be >= 1, but is {self.batch_size}.")
        if self.text_file is not None and not Path(self.text_file).is_file():
            what = "is a folder, not a file" if Path(self.text_file).is_dir() else "does not exist"
            result.add_error(f"`text_file` {str(self.text_file)!r} {what} (one example per line, UTF-8).")
        return result


@dataclass(kw_only=True)
class MlmDataSection(TextDataSection):
    """The ``data`` section of the MLM recipe (the masks of batch ``k`` of epoch ``e`` are the same on every run,
    for any number of ranks)."""

    mask_prob: float = 0.15
    """Fraction of byte tokens chosen as MLM targets (at least one per example)."""

    def validate(self) -> ValidationResult:
        result = super().validate()
        if not 0.0 < self.mask_prob < 1.0:
            result.add_error(f"`mask_prob` must be in (0, 1), but is {self.mask_prob}.")
        return result


@final
class TokenBatch(SupportsDeviceTransfer):
    """Right-padded rows: the model reads ``inputs`` and is scored on ``targets`` where ``target_mask`` is set."""

    def __init__(self, inputs: Tensor, targets: Tensor, target_mask: Tensor, seq_lens: list[int]) -> None:
        self.inputs = inputs
        self.targets = targets
        self.target_mask = target_mask
        self.seq_lens = seq_lens

    @override
    def to(self, device: Device, *, non_blocking: bool = False) -> None:
        self.inputs = self.inputs.to(device, non_blocking=non_blocking)
        self.targets = self.targets.to(device, non_blocking=non_blocking)
        self.target_mask = self.target_mask.to(device, non_blocking=non_blocking)

    def layout(self) -> BatchLayout:
        return BatchLayout.of(self.inputs, self.seq_lens)

    def as_sequence_batch(self) -> SequenceBatch:
        """The targets as a fairseq2 ``SequenceBatch`` (for fairseq2's batch metrics)."""
        return SequenceBatch(self.targets, self.seq_lens, target_mask=self.target_mask)


def mask_tokens(tokens: Tensor, tokenizer: ByteTokenizer, mask_prob: float,
                generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """BERT masking of the byte tokens: returns ``(inputs, target_mask)``.

    Each byte token is a target with probability ``mask_prob`` (every example gets at least one); a target
    becomes ``<mask>`` (80 %), a random byte (10 %) or stays (10 %). ``<s>``, ``</s>`` and pads never are.
    """
    is_byte = tokens >= tokenizer.byte_offset
    draw = torch.rand(tokens.shape, generator=generator)
    target_mask = (draw < mask_prob) & is_byte
    # At least one target per example: the byte with the smallest draw when none was chosen.
    first = torch.where(is_byte, draw, torch.full_like(draw, 2.0)).argmin(dim=1)
    none_chosen = ~target_mask.any(dim=1) & is_byte.any(dim=1)
    target_mask[none_chosen, first[none_chosen]] = True
    action = torch.rand(tokens.shape, generator=generator)
    random_bytes = torch.randint(tokenizer.byte_offset, tokenizer.vocab_size, tokens.shape, generator=generator)
    inputs = tokens.clone()
    inputs = torch.where(target_mask & (action < 0.8), torch.full_like(tokens, tokenizer.mask_idx), inputs)
    inputs = torch.where(target_mask & (action >= 0.8) & (action < 0.9), random_bytes, inputs)
    return inputs, target_mask


def pad_rows(examples: list[list[int]], pad_idx: int) -> tuple[Tensor, list[int]]:
    """Right-padded token rows (len(examples), longest) and each row's length."""
    seq_lens = [len(e) for e in examples]
    tokens = torch.full((len(examples), max(seq_lens)), pad_idx, dtype=torch.long)
    for row, example in enumerate(examples):
        tokens[row, : len(example)] = torch.tensor(example)
    return tokens, seq_lens


class EpochReader(DataReader[TokenBatch]):
    """Shuffled batches over a list of encoded examples; one data epoch per pass.

    Deterministic: the order of epoch ``e`` depends only on ``(seed, e)``, so the state is just ``(epoch, batch)``
    and a resumed run sees the same batches. Batch ``k`` of the run is the same *global* batch (``batch_size *
    world_size`` examples) whatever the number of ranks; rank ``r`` reads its contiguous share of it, so a run on
    N ranks follows the single-process run at the same global batch. Every rank runs the same number of steps per
    epoch (a rank with one batch more would wait forever in DDP): a last global batch too small to give every rank
    an example is dropped. Subclasses turn the global batch's rows into a :class:`TokenBatch`.
    """

    def __init__(self, examples: list[list[int]], section: TextDataSection, tokenizer: ByteTokenizer,
                 *, rank: int = 0, world_size: int = 1) -> None:
        if len(examples) < world_size:
            raise ValueError(f"the corpus has {len(examples)} examples: too few for {world_size} ranks")
        self._examples = examples
        self._rank = rank
        self._world_size = world_size
        self._section = section
        self._tokenizer = tokenizer
        self.load_state_dict({"epoch": 0, "batch": 0})

    def _global_batch(self, tokens: Tensor, seq_lens: list[int], number: int) -> TokenBatch:
        """The batch of the global batch's padded rows (``number``: its place in the epoch)."""
        raise NotImplementedError

    @override
    def __next__(self) -> list[TokenBatch]:
        size = self._section.batch_size * self._world_size
        chosen = self._order[self._batch * size:(self._batch + 1) * size]
        if len(chosen) < self._world_size:
            raise StopIteration
        self._batch += 1
        batch = self._global_batch(*pad_rows([self._examples[i] for i in chosen], self._tokenizer.pad_idx),
                                   self._batch - 1)
        # this rank's contiguous share (sizes differ by at most one), trimmed to its longest row
        base, extra = divmod(len(chosen), self._world_size)
        lo = self._rank * base + min(self._rank, extra)
        hi = lo + base + (1 if self._rank < extra else 0)
        seq_lens = batch.seq_lens[lo:hi]
        width = max(seq_lens)
        return [TokenBatch(batch.inputs[lo:hi, :width], batch.targets[lo:hi, :width],
                           batch.target_mask[lo:hi, :width], seq_lens)]

    @override
    def __iter__(self) -> Self:
        return self

    @override
    def reset(self) -> None:
        """Start the next data epoch (a new shuffle)."""
        self.load_state_dict({"epoch": self._epoch + 1, "batch": 0})

    @override
    def state_dict(self) -> dict[str, object]:
        return {"epoch": self._epoch, "batch": self._batch}

    @override
    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self._epoch = int(state_dict["epoch"])  # type: ignore[call-overload]
        self._batch = int(state_dict["batch"])  # type: ignore[call-overload]
        self._order = list(range(len(self._examples)))
        random.Random(self._section.seed * 1_000_003 + self._epoch).shuffle(self._order)

    @property
    @override
    def num_accumulate(self) -> int:
        return 1


@final
class MlmDataReader(EpochReader):
    """:class:`EpochReader`'s batches, masked: the masks of batch ``k`` of epoch ``e`` depend only on
    ``(seed, e, k)`` and are drawn for the global batch, so every number of ranks sees the same ones."""

    @override
    def _global_batch(self, tokens: Tensor, seq_lens: list[int], number: int) -> TokenBatch:
        batch_seed = ((self._section.seed * 1_000_003 + self._epoch) * 1_000_003 + number) % 2**63
        generator = torch.Generator().manual_seed(batch_seed)
        assert isinstance(self._section, MlmDataSection)
        inputs, target_mask = mask_tokens(tokens, self._tokenizer, self._section.mask_prob, generator)
        return TokenBatch(inputs, tokens, target_mask, seq_lens)


@final
class LmDataReader(EpochReader):
    """:class:`EpochReader`'s batches of next-token targets: each row's tokens but the last, predicting the ones
    that follow."""

    @override
    def _global_batch(self, tokens: Tensor, seq_lens: list[int], number: int) -> TokenBatch:
        lens = [n - 1 for n in seq_lens]
        target_mask = torch.arange(tokens.shape[1] - 1)[None, :] < torch.tensor(lens)[:, None]
        return TokenBatch(tokens[:, :-1], tokens[:, 1:], target_mask, lens)
