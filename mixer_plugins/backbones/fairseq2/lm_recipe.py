"""A causal-language-model training recipe for the ``mixer_decoder`` family, on fairseq2's recipe machinery.

Run it with :mod:`~mixer_plugins.backbones.fairseq2.lm` (CPU is fine; nothing is downloaded), then generate from the
checkpoint::

    python -m mixer_plugins.backbones.fairseq2.lm OUT_DIR --config mixer.name=semiseparable
    python -m mixer_plugins.backbones.fairseq2.generate OUT_DIR/checkpoints --prompt "The cat" --mode beam

It trains next-token prediction on the same small generated corpus as the MLM recipe (or ``data.text_file``, one
example per line) with the byte-level tokenizer (``<s>`` text ``</s>``), checkpoints into ``OUT_DIR/checkpoints``
(each step with the model config it was trained with), and refuses a folder whose checkpoints hold another model
config, exactly as the MLM recipe does (:mod:`~mixer_plugins.backbones.fairseq2.recipe`), with the same defaults
that differ from fairseq2's (``trainer.mixed_precision.mode=off``, ``common.no_sweep_dir=true``,
``trainer.max_grad_norm=1.0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, final

from fairseq2.datasets import SequenceBatch
from fairseq2.device import Device, SupportsDeviceTransfer
from fairseq2.logging import log
from fairseq2.metrics import MetricBag
from fairseq2.metrics.common import (
    add_nll_loss_metric,
    add_seq_batch_metrics,
    update_nll_loss_metric,
    update_seq_batch_metrics,
)
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout
from fairseq2.recipe import Recipe, RecipeContext
from fairseq2.recipe.config import (
    ModelSection,
)
from fairseq2.recipe.error import RecipeError
from fairseq2.runtime.dependency import DependencyContainer, DependencyResolver
from fairseq2.task import Task
from fairseq2.trainer import TrainUnit
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from .corpus import ByteTokenizer, encode_all, generate_corpus, read_text_file
from .data import EpochReader, TextDataSection, pad_rows
from .decoder import MIXER_DECODER_FAMILY
from .recipe import (
    NonFiniteLossError,
    RecipeSections,
    _PreflightHandler,
    check_checkpoint_dir,
    create_model,
    register_mixer_cli_errors,
    save_step_metadata,
)

__all__ = ["LmBatch", "LmDataReader", "LmDataSection", "LmTrainUnit", "MixerLmConfig", "MixerLmRecipe"]

#: Arch used when the command line names none.
DEFAULT_ARCH: Final = "tiny"


@dataclass(kw_only=True)
class LmDataSection(TextDataSection):
    """The ``data`` section of the language-model recipe."""


@final
class LmBatch(SupportsDeviceTransfer):
    """Right-padded token rows: the model reads ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``."""

    def __init__(self, tokens: Tensor, seq_lens: list[int]) -> None:
        self.tokens = tokens
        self.seq_lens = seq_lens

    @override
    def to(self, device: Device, *, non_blocking: bool = False) -> None:
        self.tokens = self.tokens.to(device, non_blocking=non_blocking)

    def inputs_and_targets(self) -> tuple[Tensor, BatchLayout, Tensor, Tensor]:
        """``(inputs, layout, targets, target_mask)``: each row's tokens but the last, and the ones that follow."""
        inputs, targets = self.tokens[:, :-1], self.tokens[:, 1:]
        layout = BatchLayout.of(inputs, [n - 1 for n in self.seq_lens])
        return inputs, layout, targets, layout.position_indices >= 0

    def as_sequence_batch(self) -> SequenceBatch:
        """The targets as a fairseq2 ``SequenceBatch`` (for fairseq2's batch metrics)."""
        return SequenceBatch(self.tokens[:, 1:], [n - 1 for n in self.seq_lens])


@final
class LmDataReader(EpochReader[LmBatch]):
    """:class:`~mixer_plugins.backbones.fairseq2.data.EpochReader`'s batches of right-padded token rows: each rank
    pads its share of the global batch to its longest row."""

    @override
    def __next__(self) -> list[LmBatch]:
        _, chosen = self._next_global()
        lo, hi = self._share(len(chosen))
        tokens, seq_lens = pad_rows(chosen[lo:hi], self._tokenizer.pad_idx)
        return [LmBatch(tokens, seq_lens)]


@dataclass(kw_only=True)
class MixerLmConfig(RecipeSections):
    """Config of :class:`MixerLmRecipe`; every field can be overridden with ``--config a.b=value``."""

    model: ModelSection = field(
        default_factory=lambda: ModelSection(family=MIXER_DECODER_FAMILY, arch=DEFAULT_ARCH)
    )
    data: LmDataSection = field(default_factory=LmDataSection)


@final
class LmTrainUnit(TrainUnit[LmBatch]):
    """Next-token cross-entropy, summed over the targets (fairseq2 normalises the gradients by their number)."""

    def __init__(self, model: Module) -> None:
        self._model = model

    @override
    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        add_nll_loss_metric(metric_bag)
        add_seq_batch_metrics(metric_bag)

    @override
    def process_batch(self, batch: LmBatch, metric_bag: MetricBag) -> tuple[Tensor, int]:
        inputs, layout, targets, target_mask = batch.inputs_and_targets()
        loss = self._model(inputs, layout, targets, target_mask=target_mask, reduction="sum")
        num_targets = int(target_mask.sum())
        if not math.isfinite(float(loss.detach())):
            raise NonFiniteLossError(
                f"the training loss is {float(loss.detach())} (not finite): training stopped; lower the learning "
                "rate (optimizer.config.lr) or check the mixer options"
            )
        update_nll_loss_metric(metric_bag, loss, num_targets)
        update_seq_batch_metrics(metric_bag, batch.as_sequence_batch())
        return loss, num_targets


@final
class MixerLmRecipe(Recipe):
    """Causal-language-model training of a ``mixer_decoder`` model on a small local corpus."""

    @override
    def register(self, container: DependencyContainer) -> None:
        register_mixer_cli_errors(container)

        def preflight_handler(resolver: DependencyResolver) -> ClusterHandler:
            check_checkpoint_dir(resolver, MixerLmConfig)
            return _PreflightHandler()

        from fairseq2.cluster import ClusterHandler

        container.collection.register(ClusterHandler, preflight_handler)

    @override
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(MixerLmConfig)
        tokenizer = ByteTokenizer()
        model = create_model(context, TransformerLM)
        vocab_size = model.final_proj.output_dim
        if vocab_size < tokenizer.vocab_size or model.pad_idx != tokenizer.pad_idx:
            raise RecipeError(
                f"the recipe's byte-level tokenizer needs vocab_size >= {tokenizer.vocab_size} and pad_idx = "
                f"{tokenizer.pad_idx}, but the model has vocab_size={vocab_size}, pad_idx={model.pad_idx}"
            )
        if config.data.max_seq_len > model.max_seq_len:
            raise RecipeError(
                f"data.max_seq_len={config.data.max_seq_len} exceeds the model's max_seq_len={model.max_seq_len}; "
                "lower data.max_seq_len or raise model.config_overrides.max_seq_len"
            )
        if config.data.text_file is not None:
            try:
                texts = read_text_file(config.data.text_file)
            except (OSError, ValueError) as ex:
                raise RecipeError(str(ex)) from None
        else:
            texts = generate_corpus(config.data.num_examples, seed=config.data.corpus_seed)
        examples = encode_all(tokenizer, texts, config.data.max_seq_len)
        gangs = context.gangs
        reader = LmDataReader(examples, config.data, tokenizer, rank=gangs.dp.rank, world_size=gangs.dp.size)
        mixer = model.decoder.layers[0].self_attn
        log.info("LM corpus: {} examples, mixer {!r}.", len(examples), getattr(mixer, "mixer_name", type(mixer)))
        trainer = context.create_trainer(LmTrainUnit(context.get_data_parallel_model()), reader)
        if gangs.root.rank == 0:
            from fairseq2.checkpoint import CheckpointDir

            ckpt_dir = Path(context.resolver.resolve(CheckpointDir).path or context.output_dir / "checkpoints")
            trainer.register_checkpoint_save_hook(lambda args: save_step_metadata(ckpt_dir, args.step_nr))
        return trainer

    @property
    @override
    def config_kls(self) -> type[object]:
        return MixerLmConfig

