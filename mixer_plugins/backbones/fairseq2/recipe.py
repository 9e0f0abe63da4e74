"""The recipes on fairseq2's recipe machinery: masked-language-model training of a ``mixer_encoder``
(:class:`MixerMlmRecipe`) and causal-language-model training of a ``mixer_decoder`` (:class:`MixerLmRecipe`), both
on :class:`TextRecipe`.

Run them (CPU is fine; nothing is downloaded)::

    python -m mixer_plugins.backbones.fairseq2 OUT_DIR --config mixer.name=quasi mixer.options.d_state=32
    python -m mixer_plugins.backbones.fairseq2 --dump-config      # every option, as YAML
    python -m mixer_plugins.backbones.fairseq2.lm OUT_DIR --config mixer.name=semiseparable
    python -m mixer_plugins.backbones.fairseq2.generate OUT_DIR/checkpoints --prompt "The cat" --mode beam

Both train on a small generated corpus (or ``data.text_file``, one example per line) with a byte-level tokenizer,
the MLM recipe with BERT-style masking, the LM recipe on next-token prediction, and checkpoint into
``OUT_DIR/checkpoints`` (reloaded by :func:`~mixer_plugins.backbones.fairseq2.load_mixer_checkpoint`). Defaults that
differ from fairseq2's: ``trainer.mixed_precision.mode=off`` (fairseq2's static bf16 becomes bf16 autocast on one
device, very slow on CPU), ``common.no_sweep_dir=true`` and ``trainer.max_grad_norm=1.0``. Every saved step keeps
the model config it was trained with (``step_N/model.yaml``); a rerun into a folder whose checkpoints hold another
model config is refused before anything is written (``overwrite_checkpoints=true`` deletes them instead). See
docs/fairseq2.md.
"""

from __future__ import annotations

import io
import math
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, TypeGuard, TypeVar, final

from fairseq2.cluster import ClusterHandler
from fairseq2.logging import log
from fairseq2.metrics import MetricBag
from fairseq2.metrics.common import (
    add_nll_loss_metric,
    add_seq_batch_metrics,
    update_nll_loss_metric,
    update_seq_batch_metrics,
)
from fairseq2.models.transformer_lm import TransformerLM
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
from fairseq2.runtime.dependency import DependencyContainer, DependencyResolver
from fairseq2.task import Task
from fairseq2.trainer import TrainUnit
from fairseq2.utils.validation import ValidationResult
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

import mixer_plugins.errors as mixer_errors

from ...registry.registry import normalize_name
from .checkpoint import MODEL_METADATA, read_model_metadata, saved_steps
from .corpus import ByteTokenizer, encode_all, generate_corpus, read_text_file
from .data import EpochReader, LmDataReader, MlmDataReader, MlmDataSection, TextDataSection, TokenBatch
from .decoder import MIXER_DECODER_FAMILY
from .encoder import MIXER_ENCODER_FAMILY, MixerEncoderModel

__all__ = ["CheckpointConfigMismatchError", "LossTrainUnit", "MixerLmConfig", "MixerLmRecipe", "MixerMlmConfig",
           "MixerMlmRecipe", "MixerSection", "NonFiniteLossError", "RecipeSections", "TextRecipe", "create_model",
           "optimizer_problems"]

#: Arch used when the command line names none.
DEFAULT_ARCH: Final = "tiny"


@dataclass(kw_only=True)
class MixerSection:
    """The recipe's ``mixer`` section: the token mixer of the model, shown by ``--dump-config``.

    fairseq2 keeps a model's own fields in ``model.config_overrides``, an untyped mapping that is empty (``null``)
    until given and is merged over the arch's config only when the model is built; so ``--dump-config`` cannot show
    ``mixer``. This typed section can: ``--config mixer.name=quasi mixer.options.d_state=32`` is folded into
    ``model.config_overrides`` (``mixer=quasi``, ``mixer_options={quasi: {d_state: 32}}``) when the recipe config
    is built. Both ways work; naming two different mixers is a config error.
    """

    name: str | None = None
    """Any registered mixer name or alias (``mixer-plugins list``); ``null``: the arch's own mixer
    (``attention`` for tiny, small and base; ``quasiseparable`` for base_hydra)."""

    options: dict[str, object] = field(default_factory=dict)
    """Options of that mixer (``mixer-plugins info NAME``), e.g. ``{d_state: 32}``; the model supplies
    ``dim``, and ``num_heads``/``max_seq_len`` unless given here."""

    def apply_to(self, config_overrides: object | None) -> object | None:
        """``config_overrides`` (a model section's) with this section folded in; unchanged when it is empty.

        What cannot be folded (the overrides name another mixer, options without a name, overrides that are not a
        mapping) is left out and reported by :meth:`validate`, which fairseq2 calls on the recipe config.
        """
        self._problems: list[str] = []
        if self.name is None and not self.options:
            return config_overrides
        if config_overrides is None:
            config_overrides = {}
        if not isinstance(config_overrides, Mapping):
            self._problems.append("`model.config_overrides` must be a mapping to combine it with the `mixer` "
                                  "section.")
            return config_overrides
        overrides = dict(config_overrides)
        given = overrides.get("mixer")
        if self.name is not None:
            if given is not None and normalize_name(str(given)) != normalize_name(self.name):
                self._problems.append(f"`mixer.name={self.name}` and `model.config_overrides.mixer={given}` name "
                                      "two different mixers; give one of them.")
                return config_overrides
            overrides["mixer"] = self.name
        name = overrides.get("mixer")
        if self.options:
            if name is None:
                self._problems.append("`mixer.options` needs `mixer.name`: the options belong to a named mixer.")
                return config_overrides
            per_mixer = dict(overrides.get("mixer_options") or {})
            per_mixer[str(name)] = {**dict(per_mixer.get(str(name)) or {}), **self.options}
            overrides["mixer_options"] = per_mixer
        return overrides

    def validate(self) -> ValidationResult:
        """What :meth:`apply_to` could not fold (fairseq2 reports it as a config error)."""
        result = ValidationResult()
        for problem in getattr(self, "_problems", []):
            result.add_error(problem)
        return result


def _default_trainer() -> TrainerSection:
    # fairseq2's default (static bf16) turns into bf16 autocast outside FSDP: ~100x slower on CPU.
    return TrainerSection(mixed_precision=MixedPrecisionConfig(mode="off"), max_grad_norm=1.0)


@dataclass(kw_only=True)
class RecipeSections:
    """The config sections both recipes share, with the defaults that differ from fairseq2's; every field can be
    overridden with ``--config a.b=value``."""

    model: ModelSection
    data: TextDataSection
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
    overwrite_checkpoints: bool = False
    """Delete the output folder's checkpoints when they belong to another model config (refused otherwise)."""
    mixer: MixerSection = field(default_factory=MixerSection)
    """The token mixer (``mixer.name``, ``mixer.options``), folded into ``model.config_overrides``."""

    def __post_init__(self) -> None:
        self.model.config_overrides = self.mixer.apply_to(self.model.config_overrides)

    def validate(self) -> ValidationResult:
        """Called by fairseq2 on the recipe config, before anything is written: the optimizer settings that
        ``torch.optim`` would refuse with a stack trace once training starts (:func:`optimizer_problems`)."""
        result = ValidationResult()
        for problem in optimizer_problems(self.optimizer.config):
            result.add_error(problem)
        return result


@dataclass(kw_only=True)
class MixerMlmConfig(RecipeSections):
    """Config of :class:`MixerMlmRecipe`; every field can be overridden with ``--config a.b=value``."""

    model: ModelSection = field(default_factory=lambda: ModelSection(family=MIXER_ENCODER_FAMILY, arch=DEFAULT_ARCH))
    data: MlmDataSection = field(default_factory=MlmDataSection)


@dataclass(kw_only=True)
class MixerLmConfig(RecipeSections):
    """Config of :class:`MixerLmRecipe`; every field can be overridden with ``--config a.b=value``."""

    model: ModelSection = field(default_factory=lambda: ModelSection(family=MIXER_DECODER_FAMILY, arch=DEFAULT_ARCH))
    data: TextDataSection = field(default_factory=TextDataSection)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _setting(settings: object, name: str) -> object:
    """A field of an optimizer config: an attribute of the structured config, or an entry of the mapping it is
    structured from."""
    return settings.get(name) if isinstance(settings, Mapping) else getattr(settings, name, None)


def _hyperparameter_problems(settings: object, where: str) -> list[str]:
    """What ``torch.optim`` refuses in one optimizer's (or parameter group's) ``lr``, ``eps``, ``weight_decay`` and
    ``betas``: a negative or non-finite value, a beta outside [0, 1). Fields it does not have, or leaves to the
    default, are skipped."""
    problems = []
    for name in ("lr", "eps", "weight_decay"):
        value = _setting(settings, name)
        if _is_number(value) and not (math.isfinite(value) and value >= 0):
            problems.append(f"`{where}.{name}` must be a finite number >= 0, but is {value}.")
    betas = _setting(settings, "betas")
    if isinstance(betas, (tuple, list)):
        for i, beta in enumerate(betas):
            if _is_number(beta) and not 0 <= beta < 1:
                problems.append(f"`{where}.betas[{i}]` must be in [0, 1), but is {beta}.")
    return problems


def optimizer_problems(config: object, where: str = "optimizer.config") -> list[str]:
    """The optimizer config's values that ``torch.optim`` would refuse when the trainer builds it, as messages:
    its own ``lr``, ``eps``, ``weight_decay`` and ``betas`` and those of each of its parameter ``groups``."""
    problems = _hyperparameter_problems(config, where)
    groups = _setting(config, "groups")
    for i, group in enumerate(groups if isinstance(groups, (list, tuple)) else []):
        problems += _hyperparameter_problems(group, f"{where}.groups[{i}]")
    return problems


def _allocation_failure(error: BaseException) -> str | None:
    """torch's message (one line) when ``error`` says a tensor could not be allocated, else None."""
    text = " ".join(str(error).split())
    if isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and any(
            marker in text.lower() for marker in ("can't allocate", "cannot allocate", "out of memory", "overflow"))):
        return re.sub(r"^\[enforce fail at [^\]]*\] err == 0\. ", "", text)
    return None


ModelT = TypeVar("ModelT", bound=Module)


def create_model(context: RecipeContext, kls: type[ModelT]) -> ModelT:
    """``context.get_model_as(kls)``, where fairseq2 builds the model; a model too large to allocate is a config
    error (one line, exit status 2) that names the sizes to lower, not a stack trace."""
    try:
        return context.get_model_as(kls)
    except (RuntimeError, MemoryError) as ex:
        reason = _allocation_failure(ex)
        if reason is None:
            raise
        section = context.get_config_as(RecipeSections).model
        overrides = section.config_overrides if isinstance(section.config_overrides, Mapping) else {}
        given = ", ".join(f"{k}={v}" for k, v in overrides.items()
                          if k in ("model_dim", "num_layers", "ffn_inner_dim", "vocab_size", "max_seq_len"))
        raise RecipeError(
            f"the model (model.arch={section.arch}{', ' + given if given else ''}) cannot be allocated: {reason}; "
            "lower model.config_overrides.model_dim, num_layers, ffn_inner_dim or vocab_size"
        ) from None


class CheckpointConfigMismatchError(RuntimeError):
    """The output folder holds checkpoints of another model config; nothing was written."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite: the run stops instead of saving a broken model."""


@final
class LossTrainUnit(TrainUnit[TokenBatch]):
    """The model's loss on the batch's targets, summed (fairseq2 normalises the gradients by their number): the MLM
    loss of a ``mixer_encoder``, the next-token loss of a ``mixer_decoder``."""

    def __init__(self, model: Module) -> None:
        self._model = model

    @override
    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        add_nll_loss_metric(metric_bag)
        add_seq_batch_metrics(metric_bag)

    @override
    def process_batch(self, batch: TokenBatch, metric_bag: MetricBag) -> tuple[Tensor, int]:
        loss = self._model(batch.inputs, batch.layout(), batch.targets, target_mask=batch.target_mask,
                           reduction="sum")
        num_targets = int(batch.target_mask.sum())
        if not math.isfinite(float(loss.detach())):
            raise NonFiniteLossError(
                f"the training loss is {float(loss.detach())} (not finite): training stopped; lower the learning "
                "rate (optimizer.config.lr) or check the mixer options"
            )
        update_nll_loss_metric(metric_bag, loss, num_targets)
        update_seq_batch_metrics(metric_bag, batch.as_sequence_batch())
        return loss, num_targets


def _log_mixer_error(ex: Exception) -> int:
    # Our errors say what is wrong and what would be right; a stack trace adds nothing for the user.
    log.error(f"{type(ex).__name__}: {ex}")
    return 2


def _log_training_failure(ex: Exception) -> int:
    log.error(f"{type(ex).__name__}: {ex}")
    return 1


def register_mixer_cli_errors(container: DependencyContainer) -> None:
    """Report our errors as one line and exit status 2 (fairseq2 picks a handler by the exception's exact type, so
    every error class of :mod:`mixer_plugins.errors` is registered), and a non-finite loss as a training failure."""
    for name in mixer_errors.__all__:
        kls = getattr(mixer_errors, name)
        if issubclass(kls, mixer_errors.MixerError):
            register_cli_error(container, kls, _log_mixer_error)
    register_cli_error(container, CheckpointConfigMismatchError, _log_mixer_error)
    register_cli_error(container, NonFiniteLossError, _log_training_failure)


def save_step_metadata(checkpoint_dir: Path, step_nr: int) -> None:
    """Copy the run's ``model.yaml`` (written by fairseq2 when this run started) into ``step_<step_nr>/``, atomically
    (a temporary file, then a rename): the step then records the model config it was trained with."""
    source = Path(checkpoint_dir) / MODEL_METADATA
    step_dir = Path(checkpoint_dir) / f"step_{step_nr}"
    if not source.is_file() or not step_dir.is_dir():
        return
    target = step_dir / MODEL_METADATA
    tmp = step_dir / f".{MODEL_METADATA}.tmp"
    tmp.write_bytes(source.read_bytes())
    os.replace(tmp, target)


def step_metadata(resolver: DependencyResolver, checkpoint_dir: Path, step_nr: int, *,
                  fields: set[str] | None = None) -> tuple[dict[str, Any] | None, Path | None]:
    """The model metadata step ``step_nr`` was trained with, and the file it came from: the step's own copy, else the
    folder's ``model.yaml`` (a step without its own copy); (None, None) when neither can be read.

    With ``fields`` (the fields of the model config being compared), a file whose config has other fields is taken
    for cut (YAML cut between two lines still parses, with the last fields missing) and skipped.
    """
    for path in (Path(checkpoint_dir) / f"step_{step_nr}" / MODEL_METADATA, Path(checkpoint_dir) / MODEL_METADATA):
        saved = read_model_metadata(resolver, path)
        if saved is not None and (fields is None or set(saved["model_config"]) == fields):
            return saved, path
    return None, None


def check_checkpoint_dir(resolver: DependencyResolver) -> None:
    """Refuse (before anything is written) an output folder whose checkpoints belong to another model config.

    The config compared is the one the last saved step was trained with (``step_N/model.yaml``; for a step without
    its own copy, the folder's ``model.yaml``), never a file fairseq2 rewrites at start: an empty
    or cut ``checkpoints/model.yaml`` (a start killed while writing it) does not make a resumable folder look foreign.
    With ``overwrite_checkpoints=true`` checkpoints of another config are deleted instead.
    """
    from fairseq2.checkpoint import CheckpointDir
    from fairseq2.models import ModelFamily
    from fairseq2.recipe.internal.asset_config import _AssetConfigOverrider
    from fairseq2.runtime.dependency import DependencyLookup
    from fairseq2.utils.structured import ValueConverter
    from fairseq2.utils.yaml import YamlDumper, YamlLoader

    context = RecipeContext(resolver)
    config = context.get_config_as(RecipeSections)
    section = config.model
    if section.path is not None or section.name is not None or section.family is None:
        return  # not a new model of ours: fairseq2's own checks apply
    ckpt_dir = Path(resolver.resolve(CheckpointDir).path or context.output_dir.joinpath("checkpoints"))
    steps = saved_steps(ckpt_dir)
    if not steps:
        return  # no saved step to lose
    family = DependencyLookup(resolver, ModelFamily).maybe_get(section.family)
    if family is None:
        return  # fairseq2 reports the unknown family
    model_config = family.maybe_get_arch_config(section.arch) if section.arch is not None else family.config_kls()
    if model_config is None:
        return  # fairseq2 reports the unknown arch
    model_config = resolver.resolve(_AssetConfigOverrider).apply_overrides(
        "model", model_config, section.config_overrides)
    # in the form model.yaml is read back in (through fairseq2's YAML dumper and loader)
    stream = io.StringIO()
    resolver.resolve(YamlDumper).dump({"name": "checkpoint", "model_family": family.name,
                                       "model_config": resolver.resolve(ValueConverter).unstructure(model_config)},
                                      stream)
    stream.seek(0)
    [round_tripped] = resolver.resolve(YamlLoader).load(stream)
    wanted: dict[str, Any] = round_tripped if isinstance(round_tripped, dict) else {}
    saved, source = step_metadata(resolver, ckpt_dir, steps[-1], fields=set(wanted["model_config"]))
    if saved is None:
        log.warning("The model config of step {} in {} cannot be read (no intact model.yaml); resuming from it, and "
                    "fairseq2's strict load will refuse weights that do not fit the model.", steps[-1], ckpt_dir)
        return
    if (saved.get("model_family"), saved.get("model_config")) == (wanted["model_family"], wanted["model_config"]):
        return  # the same model: fairseq2 resumes from the last step
    old, new = saved["model_config"], wanted["model_config"]
    if saved.get("model_family") != wanted["model_family"]:
        differ = [f"model_family: {saved.get('model_family')!r} -> {wanted['model_family']!r}"]
    else:
        differ = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
                  for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    what = ", ".join(differ[:4]) or "the model config differs"
    if config.overwrite_checkpoints:
        log.warning("overwrite_checkpoints=true: deleting {} (checkpoints of another model config: {}).",
                    ckpt_dir, what)
        shutil.rmtree(ckpt_dir)
        return
    loadable = ""
    if source is not None and source.parent != ckpt_dir:  # the step has its own config: load_mixer_checkpoint reads it
        loadable = f"; they stay loadable with load_mixer_checkpoint({str(ckpt_dir)!r})"
    raise CheckpointConfigMismatchError(
        f"{ckpt_dir} holds checkpoints of another model config ({what}; read from {source}); nothing was written"
        f"{loadable}. Use another output folder."
    )


@final
class _PreflightHandler(ClusterHandler):
    """A cluster handler that supports no cluster: its provider is where the output folder is checked."""

    @override
    def set_torch_distributed_env_variables(self) -> None:  # pragma: no cover - never selected
        pass

    @override
    def supports_current_cluster(self) -> bool:
        return False

    @property
    @override
    def cluster(self) -> str:
        return "mixer-plugins-preflight"


class TextRecipe(Recipe):
    """What both recipes do: check the output folder before anything is written, build the model, read the corpus
    with the byte-level tokenizer, train with :class:`LossTrainUnit` and keep each step's model config. A recipe
    names its config, its model class and its data reader."""

    config_class: ClassVar[type[RecipeSections]]
    model_class: ClassVar[type[Module]]
    reader_class: ClassVar[type[EpochReader]]
    task: ClassVar[str]

    @override
    def register(self, container: DependencyContainer) -> None:
        register_mixer_cli_errors(container)

        # The output folder is checked at the first thing a run resolves, before its logs, config.yaml or
        # model.yaml are written: the cluster handlers (fairseq2's container allows no override, but a
        # collection takes one more member; ours never claims the cluster).
        def preflight_handler(resolver: DependencyResolver) -> ClusterHandler:
            check_checkpoint_dir(resolver)
            return _PreflightHandler()

        container.collection.register(ClusterHandler, preflight_handler)

    @override
    def create_task(self, context: RecipeContext) -> Task:
        config = context.get_config_as(self.config_class)
        tokenizer = ByteTokenizer()
        model = create_model(context, self.model_class)
        vocab_size, pad_idx, max_seq_len = _vocabulary(model)
        if vocab_size < tokenizer.vocab_size or pad_idx != tokenizer.pad_idx:
            raise RecipeError(
                f"the recipe's byte-level tokenizer needs vocab_size >= {tokenizer.vocab_size} and pad_idx = "
                f"{tokenizer.pad_idx}, but the model has vocab_size={vocab_size}, pad_idx={pad_idx}"
            )
        if config.data.max_seq_len > max_seq_len:
            raise RecipeError(
                f"data.max_seq_len={config.data.max_seq_len} exceeds the model's max_seq_len={max_seq_len}; "
                "lower data.max_seq_len or raise model.config_overrides.max_seq_len"
            )
        if config.data.text_file is not None:
            try:
                texts = read_text_file(config.data.text_file)
            except (OSError, ValueError) as ex:  # a config error: one line, exit status 2
                raise RecipeError(str(ex)) from None
        else:
            texts = generate_corpus(config.data.num_examples, seed=config.data.corpus_seed)
        examples = encode_all(tokenizer, texts, config.data.max_seq_len)
        gangs = context.gangs
        reader = self.reader_class(examples, config.data, tokenizer, rank=gangs.dp.rank, world_size=gangs.dp.size)
        mixer = next(m for m in model.modules() if hasattr(m, "mixer_name"))
        log.info("{} corpus: {} examples, mixer {!r}.", self.task, len(examples), mixer.mixer_name)
        trainer = context.create_trainer(LossTrainUnit(context.get_data_parallel_model()), reader)
        if gangs.root.rank == 0:
            from fairseq2.checkpoint import CheckpointDir

            ckpt_dir = Path(context.resolver.resolve(CheckpointDir).path or context.output_dir / "checkpoints")
            trainer.register_checkpoint_save_hook(lambda args: save_step_metadata(ckpt_dir, args.step_nr))
        return trainer

    @property
    @override
    def config_kls(self) -> type[object]:
        return self.config_class


def _vocabulary(model: Module) -> tuple[int, int | None, int]:
    """A model's vocabulary size, padding index and longest sequence."""
    if isinstance(model, TransformerLM):
        return model.final_proj.output_dim, model.pad_idx, model.max_seq_len
    assert isinstance(model, MixerEncoderModel)
    return model.vocab_size, model.pad_idx, model.max_seq_len


@final
class MixerMlmRecipe(TextRecipe):
    """Masked-language-model pretraining of a ``mixer_encoder`` model on a small local corpus."""

    config_class = MixerMlmConfig
    model_class = MixerEncoderModel
    reader_class = MlmDataReader
    task = "MLM"


@final
class MixerLmRecipe(TextRecipe):
    """Causal-language-model training of a ``mixer_decoder`` model on a small local corpus."""

    config_class = MixerLmConfig
    model_class = TransformerLM
    reader_class = LmDataReader
    task = "LM"
