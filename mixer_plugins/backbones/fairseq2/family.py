"""The skeleton the ``mixer_encoder`` and ``mixer_decoder`` families share: config -> model factory -> registration.

fairseq2 structures model configs strictly from dataclasses (unknown keys are errors), merges recipe
``--config model.config_overrides.<field>=<value>`` into them, and calls ``validate()`` on the result. So a family's
whole user-facing surface is its config dataclass (:class:`MixerModelConfig` plus the family's own fields); the one
field a user flips is ``mixer``. A :class:`MixerFamily` names the config, the factory and the presets (archs), and
registers them with fairseq2 from our extension entry point.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal

from fairseq2.composition import register_model_family
from fairseq2.models.transformer import StandardFeedForwardNetwork, TransformerNormOrder
from fairseq2.nn import (
    LearnedPositionEncoder,
    PositionEncoder,
    SinusoidalPositionEncoder,
    StandardEmbedding,
    StandardLayerNorm,
    init_scaled_embedding,
)
from fairseq2.runtime.config_registry import ConfigRegistrar
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.utils.validation import ValidationResult
from torch.nn import GELU, Module

from .checkpoint import with_mixer_records
from .options import ResolvedMixer, mixer_problems, resolve_mixer

__all__ = ["BYTE_VOCAB_SIZE", "SMALL_ARCH", "TINY_ARCH", "MixerFamily", "MixerModelConfig", "build_embedding",
           "build_ffn", "build_final_norm", "build_layer_norm", "checked_mixer"]

#: 256 byte values + pad, mask, bos, eos, rounded up to a multiple of 8: the vocabulary of the recipes' byte-level
#: tokenizer (the ``tiny`` and ``small`` archs use it, so they train on raw text).
BYTE_VOCAB_SIZE: Final = 264

#: The small presets every family has, on the byte-level vocabulary: ``tiny`` for tests and smoke runs (a few tens of
#: thousands of parameters), ``small`` to learn the bundled corpus on a CPU in minutes.
TINY_ARCH: Final = dict(model_dim=32, num_layers=2, num_heads=4, ffn_inner_dim=64, vocab_size=BYTE_VOCAB_SIZE,
                        max_seq_len=128, dropout_p=0.0)
SMALL_ARCH: Final = dict(model_dim=256, num_layers=4, num_heads=4, ffn_inner_dim=1024, vocab_size=BYTE_VOCAB_SIZE,
                         max_seq_len=512, dropout_p=0.1)


@dataclass(kw_only=True)
class MixerModelConfig:
    """The fields of every model family of ours: a Transformer whose token mixer is any registered mixer.

    Layer ``i`` is ``x + mixer(norm(x))`` then ``x + ffn(norm(x))`` (pre-norm) or the post-norm equivalent.
    """

    #: The host is a decoder: the mixer must run causally (``causal=True`` is filled in where it has the option).
    causal: ClassVar[bool] = False
    #: The fields that must be >= 1.
    positive: ClassVar[tuple[str, ...]] = ("model_dim", "num_layers", "vocab_size", "max_seq_len", "ffn_inner_dim")

    model_dim: int = 768
    """Width of the model (the mixer's ``dim``)."""

    num_layers: int = 12
    """Number of layers."""

    num_heads: int | None = 12
    """Given to mixers that have a ``num_heads`` option unless set under ``mixer_options``; ``None``: the mixer's
    own default."""

    ffn_inner_dim: int = 3072
    """Inner width of the feed-forward block (GELU)."""

    vocab_size: int
    """Size of the token vocabulary."""

    pad_idx: int = 0
    """Index of the padding token."""

    max_seq_len: int
    """Longest sequence: sizes the learned/sinusoidal position table, and is given to mixers that have a
    ``max_seq_len`` option (data-independent mixers) unless set under ``mixer_options``."""

    pos_encoder: Literal["learned", "sinusoidal", "none"] = "learned"
    """Absolute position encoding added to the token embeddings; ``none`` leaves order to the mixer."""

    norm_order: TransformerNormOrder = TransformerNormOrder.PRE
    """``PRE`` (stable default) or ``POST`` (BERT, Hydra); given by name on the command line."""

    layer_norm_eps: float = 1e-5
    """Epsilon of every layer norm."""

    dropout_p: float = 0.1
    """Dropout on the embeddings and on the outputs of the mixer and feed-forward blocks."""

    mixer: str = "attention"
    """The token mixer: any registered name or alias (``mixer-plugins list``); a decoder's needs a causal form."""

    mixer_options: dict[str, object] = field(default_factory=dict)
    """Options per mixer name, e.g. ``{"quasi": {"d_state": 32}}``; only ``mixer``'s entry is used."""

    def host_options(self) -> dict[str, int | None]:
        """Options the model supplies to mixers that have them (unless set under ``mixer_options``)."""
        return {"num_heads": self.num_heads, "max_seq_len": self.max_seq_len}

    def resolve_mixer(self) -> ResolvedMixer:
        """The chosen mixer's spec and validated config; raises our registry errors when invalid."""
        return resolve_mixer(self.mixer, self.mixer_options, dim=self.model_dim, host_options=self.host_options(),
                             causal=self.causal)

    def structural_problems(self) -> list[str]:
        """Problems with the non-mixer fields (sizes, probabilities), as messages."""
        problems = [f"`{name}` must be >= 1, but is {getattr(self, name)}." for name in self.positive
                    if getattr(self, name) < 1]
        if self.num_heads is not None and self.num_heads < 1:
            problems.append(f"`num_heads` must be >= 1 or None, but is {self.num_heads}.")
        if not 0 <= self.pad_idx < max(self.vocab_size, 1):
            problems.append(f"`pad_idx` must be in [0, vocab_size={self.vocab_size}), but is {self.pad_idx}.")
        if not 0.0 <= self.dropout_p < 1.0:
            problems.append(f"`dropout_p` must be in [0, 1), but is {self.dropout_p}.")
        if self.layer_norm_eps <= 0:
            problems.append(f"`layer_norm_eps` must be > 0, but is {self.layer_norm_eps}.")
        if self.pos_encoder == "sinusoidal" and self.model_dim % 2:
            problems.append(f"`pos_encoder=sinusoidal` needs an even `model_dim`, but it is {self.model_dim}.")
        return problems

    def validate(self) -> ValidationResult:
        """Called by fairseq2 on asset-card and recipe configs: the structural problems and, with a valid width, our
        registry's messages on a bad mixer."""
        result = ValidationResult()
        for problem in self.structural_problems():
            result.add_error(problem)
        if self.model_dim >= 1:
            for problem in mixer_problems(self.mixer, self.mixer_options, dim=self.model_dim,
                                          host_options=self.host_options(), causal=self.causal):
                result.add_error(problem)
        return result


def checked_mixer(config: MixerModelConfig, kls: type[MixerModelConfig], family: str) -> ResolvedMixer:
    """What a factory does first: check ``config``'s type and fields, and resolve its mixer, so a bad mixer name or
    option raises our registry error (``UnknownMixerError``, ``InvalidMixerOptions``) before anything is built, also
    on paths where fairseq2 does not validate (``hub.create_new_model``)."""
    if not isinstance(config, kls):
        raise TypeError(f"expected a {kls.__name__}, got {type(config).__name__}")
    problems = config.structural_problems()
    if problems:
        raise ValueError(f"invalid {family} config: " + " ".join(problems))
    return config.resolve_mixer()


def build_layer_norm(config: MixerModelConfig) -> StandardLayerNorm:
    return StandardLayerNorm(config.model_dim, bias=True, eps=config.layer_norm_eps)


def build_final_norm(config: MixerModelConfig) -> StandardLayerNorm | None:
    """Pre-norm stacks end with a layer norm; post-norm layers already end with one."""
    return build_layer_norm(config) if config.norm_order != TransformerNormOrder.POST else None


def build_ffn(config: MixerModelConfig) -> StandardFeedForwardNetwork:
    return StandardFeedForwardNetwork(config.model_dim, config.ffn_inner_dim, bias=True, inner_activation=GELU())


def build_embedding(config: MixerModelConfig) -> tuple[StandardEmbedding, PositionEncoder | None]:
    """The token embedding table and the position encoder (``None`` for ``pos_encoder="none"``)."""
    embed = StandardEmbedding(config.vocab_size, config.model_dim, config.pad_idx, init_fn=init_scaled_embedding)
    encoders = {"learned": LearnedPositionEncoder, "sinusoidal": SinusoidalPositionEncoder}
    kls = encoders.get(config.pos_encoder)
    return embed, None if kls is None else kls(config.model_dim, config.max_seq_len)


@dataclass(frozen=True)
class MixerFamily:
    """A model family of ours, as our extension entry point registers it with fairseq2.

    ``archs`` are the presets, by name: the fields given to ``config_kls``. The state-dict converter checks the
    mixers' records (:func:`~.checkpoint.with_mixer_records`) around ``converter``; ``compiler``, ``fsdp_applier``
    and ``layerwise_ac_applier`` go to fairseq2's ``register_model_family`` as they are.
    """

    name: str
    kls: type[Module]
    config_kls: type
    factory: Any
    archs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    converter: Any = None
    compiler: Any = None
    fsdp_applier: Any = None
    layerwise_ac_applier: Any = None
    register_more_archs: Callable[[DependencyContainer], None] | None = None

    def register(self, container: DependencyContainer) -> None:
        """Register the family and its presets in ``container``."""
        register_model_family(container, self.name, kls=self.kls, config_kls=self.config_kls, factory=self.factory,
                              state_dict_converter=with_mixer_records(self.factory, self.converter),
                              compiler=self.compiler, fsdp_applier=self.fsdp_applier,
                              layerwise_ac_applier=self.layerwise_ac_applier)
        arch: ConfigRegistrar[Any] = ConfigRegistrar(container, self.config_kls)
        for name, fields in self.archs.items():
            arch(name)(functools.partial(self.config_kls, **fields))  # a fresh config at every lookup
        if self.register_more_archs is not None:
            self.register_more_archs(container)
