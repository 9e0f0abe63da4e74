"""A masked-language-model training recipe for the ``mixer_encoder`` family, on fairseq2's recipe machinery.

Run it (CPU is fine; nothing is downloaded)::

    python -m mixer_plugins.backbones.fairseq2 OUT_DIR --config model.config_overrides.mixer=quasi
    python -m mixer_plugins.backbones.fairseq2 OUT_DIR --config model.config_overrides.mixer=quasi \\
        model.config_overrides.mixer_options.quasi.d_state=32 regime.num_steps=200
    python -m mixer_plugins.backbones.fairseq2 --dump-config      # every option, as YAML

It trains on a small generated corpus (or ``data.text_file``, one example per line) with a byte-level
tokenizer, BERT-style masking (15 %: 80 % ``<mask>``, 10 % random byte, 10 % unchanged), checkpoints into
``OUT_DIR/checkpoints`` and the result reloads through fairseq2's own ``load_model``
(:func:`~mixer_plugins.backbones.fairseq2.load_mixer_checkpoint`).

Defaults that differ from fairseq2's: ``trainer.mixed_precision.mode=off`` (fairseq2's default, static
bf16, falls back to bf16 autocast on a single device, which is very slow on CPU; on a GPU pass
``trainer.mixed_precision.mode=auto`` for bf16 autocast), ``common.no_sweep_dir=true`` (outputs directly in
``OUT_DIR``) and ``trainer.max_grad_norm=1.0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, final

from fairseq2.logging import log
from fairseq2.metrics import MetricBag
from fairseq2.metrics.common import (
    add_nll_loss_metric,
    add_seq_batch_metrics,
    update_nll_loss_metric,
    update_seq_batch_metrics,
)
from fairseq2.recipe import Recipe, RecipeContext, register_cli_error
from fairseq2.recipe.config import (
    AdamWConfig,
    CommonSection,
    GangSection,
    LRSchedulerSection,
    MixedPrecisionConfig,
    ModelSection,
    OptimizerSection,
    RegimeSection,
    TrainerSection,
)
from fairseq2.recipe.error import RecipeError
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.task import Task
from fairseq2.trainer import TrainUnit
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

import mixer_plugins.errors as mixer_errors

from .config import MIXER_ENCODER_FAMILY
from .corpus import ByteTokenizer, encode_all, generate_corpus, read_text_file
from .data import MlmBatch, MlmDataReader, MlmDataSection
from .model import MixerEncoderModel

__all__ = ["MixerMlmConfig", "MlmTrainUnit", "MixerMlmRecipe"]

#: Arch used when the command line names none.
DEFAULT_ARCH: Final = "tiny"


def _default_trainer() -> TrainerSection:
    # fairseq2's default (static bf16) turns into bf16 autocast outside FSDP: ~100x slower on CPU.
    return TrainerSection(mixed_precision=MixedPrecisionConfig(mode="off"), max_grad_norm=1.0)


@dataclass(kw_only=True)
class MixerMlmConfig:
    """Config of :class:`MixerMlmRecipe`; every field can be overridden with ``--config a.b=value``."""

    model: ModelSection = field(
        default_factory=lambda: ModelSection(family=MIXER_ENCODER_FAMILY, arch=DEFAULT_ARCH)
    )
    data: MlmDataSection = field(default_factory=MlmDataSection)
    trainer: TrainerSection = field(default_factory=_default_trainer)
    optimizer: OptimizerSection = field(
        default_factory=lambda: OptimizerSection(config=AdamWConfig(lr=1e-3, weight_decay=0.01))
    )
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    regime: RegimeSection = field(
        default_factory=lambda: RegimeSection(num_steps=300, publish_metrics_every_n_steps=10)
    )
    common: CommonSection = field(default_factory=lambda: CommonSection(no_sweep_dir=True))
    gang: GangSection = field(default_factory=GangSection)


@final
class MlmTrainUnit(TrainUnit[MlmBatch]):
    """MLM loss, summed over the targets (fairseq2 normalises the gradients by their number)."""

    def __init__(self, model: Module) -> None:
        self._model = model

    @override
    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        add_nll_loss_metric(metric_bag)
        add_seq_batch_metrics(metric_bag)

    @override
    def process_batch(self, batch: MlmBatch, metric_bag: MetricBag) -> tuple[Tensor, int]:
        layout = batch.layout()
        loss = self._model(batch.inputs, layout, batch.targets, target_mask=batch.target_mask, reduction="sum")
        num_targets = int(batch.target_mask.sum())
        update_nll_loss_metric(metric_bag, loss, num_targets)
        update_seq_batch_metrics(metric_bag, batch.as_sequence_batch())
        return loss, num_targets


def _log_mixer_error(ex: Exception) -> int:
    # Our errors say what is wrong and what would be right; a stack trace adds nothing for the user.
    log.error(f"{type(ex).__name__}: {ex}")
    return 2


@final
class MixerMlmRecipe(Recipe):
    """Masked-language-model pretraining of a ``mixer_encoder`` model on a small local corpus."""

    @override
    def register(self, container: DependencyContainer) -> None:
        for kls in (mixer_errors.MixerError, mixer_errors.UnknownMixerError, mixer_errors.InvalidMixerOptions,
                    mixer_errors.DuplicateMixerError, mixer_errors.PluginLoadError, mixer_errors.MixerInputError,
                    mixer_errors.SequenceLengthError, mixer_errors.NotMaterializableError):
            register_cli_error(container, kls, _log_mixer_error)

    @override
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(MixerMlmConfig)
        tokenizer = ByteTokenizer()
        model = context.get_model_as(MixerEncoderModel)
        if model.vocab_size < tokenizer.vocab_size or model.pad_idx != tokenizer.pad_idx:
            raise RecipeError(
                f"the recipe's byte-level tokenizer needs vocab_size >= {tokenizer.vocab_size} and pad_idx = "
                f"{tokenizer.pad_idx}, but the model has vocab_size={model.vocab_size}, pad_idx={model.pad_idx}"
            )
        if config.data.max_seq_len > model.max_seq_len:
            raise RecipeError(
                f"data.max_seq_len={config.data.max_seq_len} exceeds the model's max_seq_len={model.max_seq_len}; "
                "lower data.max_seq_len or raise model.config_overrides.max_seq_len"
            )
        if config.data.text_file is not None:
            texts = read_text_file(config.data.text_file)
        else:
            texts = generate_corpus(config.data.num_examples, seed=config.data.corpus_seed)
        examples = encode_all(tokenizer, texts, config.data.max_seq_len)
        gangs = context.gangs
        reader = MlmDataReader(examples, config.data, tokenizer, rank=gangs.dp.rank, world_size=gangs.dp.size)
        log.info("MLM corpus: {} examples, mixer {!r}.", len(examples), model.mixer_name)
        unit = MlmTrainUnit(context.get_data_parallel_model())
        return context.create_trainer(unit, reader)

    @property
    @override
    def config_kls(self) -> type[object]:
        return MixerMlmConfig
