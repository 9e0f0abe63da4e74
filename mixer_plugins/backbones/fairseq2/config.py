"""Configuration of the ``mixer_encoder`` fairseq2 model family and its architecture presets (archs).

fairseq2 structures model configs strictly from dataclasses (unknown keys are errors), merges recipe
``--config model.config_overrides.<field>=<value>`` into them, and calls ``validate()`` on the result. So
the whole user-facing surface is the dataclass below; the one field a user flips is ``mixer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from fairseq2.models.transformer import TransformerNormOrder
from fairseq2.runtime.config_registry import ConfigRegistrar
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.utils.validation import ValidationResult

from ...registry.registry import normalize_name
from .options import ResolvedMixer, mixer_problems, resolve_mixer

__all__ = [
    "MIXER_ENCODER_FAMILY",
    "BYTE_VOCAB_SIZE",
    "BERT_VOCAB_SIZE",
    "MixerEncoderConfig",
    "MixerSection",
    "register_mixer_encoder_archs",
]

MIXER_ENCODER_FAMILY: Final = "mixer_encoder"

#: 256 byte values + pad, mask, bos, eos, rounded up to a multiple of 8: the vocabulary of the byte-level
#: tokenizer of our MLM recipe (the ``tiny`` and ``small`` archs use it, so they train on raw text).
BYTE_VOCAB_SIZE: Final = 264

#: BERT's WordPiece vocabulary padded to a multiple of 8, as in the Hydra and MosaicBERT runs.
BERT_VOCAB_SIZE: Final = 30_528


@dataclass(kw_only=True)
class MixerEncoderConfig:
    """An encoder-only Transformer (BERT-like) whose token mixer is any registered mixer.

    Layer ``i`` is ``x + mixer(norm(x))`` then ``x + ffn(norm(x))`` (pre-norm) or the post-norm equivalent;
    with ``ffn_inner_dim=0`` the feed-forward block is dropped (the Hydra BERT layer is mixer-only).
    """

    model_dim: int = 768
    """Width of the model (the mixer's ``dim``)."""

    num_layers: int = 12
    """Number of encoder layers."""

    num_heads: int | None = 12
    """Given to mixers that have a ``num_heads`` option unless set under ``mixer_options``; ``None``: the
    mixer's own default."""

    ffn_inner_dim: int = 3072
    """Inner width of the feed-forward block (GELU); 0 drops the block."""

    vocab_size: int = BERT_VOCAB_SIZE
    """Size of the token vocabulary (the MLM head is tied to the embedding table)."""

    pad_idx: int = 0
    """Index of the padding token."""

    max_seq_len: int = 512
    """Longest sequence: sizes the learned/sinusoidal position table, and is given to mixers that have a
    ``max_seq_len`` option (data-independent mixers) unless set under ``mixer_options``."""

    pos_encoder: Literal["learned", "sinusoidal", "none"] = "learned"
    """Absolute position encoding added to the token embeddings; ``none`` leaves order to the mixer."""

    embed_layer_norm: bool = False
    """Layer norm on the embeddings (BERT-style, for post-norm stacks)."""

    norm_order: TransformerNormOrder = TransformerNormOrder.PRE
    """``PRE`` (stable default) or ``POST`` (BERT, Hydra); given by name on the command line."""

    layer_norm_eps: float = 1e-5
    """Epsilon of every layer norm."""

    dropout_p: float = 0.1
    """Dropout on the embeddings and on the outputs of the mixer and feed-forward blocks."""

    num_classes: int = 0
    """Classes of the sequence-classification head (``model.classify``); 0: no such head."""

    pooling: Literal["cls", "mean"] = "mean"
    """How ``classify`` pools a sequence: its first token (``cls``) or the mean over its real tokens."""

    mixer: str = "attention"
    """The token mixer: any registered name or alias (``mixer-plugins list``)."""

    mixer_options: dict[str, object] = field(default_factory=dict)
    """Options per mixer name, e.g. ``{"quasi": {"d_state": 32}}``; only ``mixer``'s entry is used."""

    # -- helpers ---------------------------------------------------------------------------------
    def host_options(self) -> dict[str, int | None]:
        """Options the model supplies to mixers that have them (unless set under ``mixer_options``)."""
        return {"num_heads": self.num_heads, "max_seq_len": self.max_seq_len}

    def resolve_mixer(self) -> ResolvedMixer:
        """The chosen mixer's spec and validated config; raises our registry errors when invalid."""
        return resolve_mixer(self.mixer, self.mixer_options, dim=self.model_dim, host_options=self.host_options())

    def structural_problems(self) -> list[str]:
        """Problems with the non-mixer fields (sizes, probabilities), as messages."""
        problems = common_problems(self, ("model_dim", "num_layers", "vocab_size", "max_seq_len"))
        if self.ffn_inner_dim < 0:
            problems.append(
                f"`ffn_inner_dim` must be >= 0 (0 drops the feed-forward block), but is {self.ffn_inner_dim}."
            )
        if self.num_classes < 0:
            problems.append(f"`num_classes` must be >= 0 (0: no classification head), but is {self.num_classes}.")
        return problems

    def validate(self) -> ValidationResult:
        """Called by fairseq2 on asset-card and recipe configs: our registry's messages on a bad mixer."""
        return validation(self, causal=False)


def common_problems(config: Any, positive: tuple[str, ...]) -> list[str]:
    """The checks the encoder and decoder configs share: the ``positive`` fields >= 1, ``num_heads``, ``pad_idx``,
    ``dropout_p``, ``layer_norm_eps`` and the sinusoidal encoder's even ``model_dim``; messages."""
    problems = [f"`{name}` must be >= 1, but is {getattr(config, name)}." for name in positive
                if getattr(config, name) < 1]
    if config.num_heads is not None and config.num_heads < 1:
        problems.append(f"`num_heads` must be >= 1 or None, but is {config.num_heads}.")
    if not 0 <= config.pad_idx < max(config.vocab_size, 1):
        problems.append(f"`pad_idx` must be in [0, vocab_size={config.vocab_size}), but is {config.pad_idx}.")
    if not 0.0 <= config.dropout_p < 1.0:
        problems.append(f"`dropout_p` must be in [0, 1), but is {config.dropout_p}.")
    if config.layer_norm_eps <= 0:
        problems.append(f"`layer_norm_eps` must be > 0, but is {config.layer_norm_eps}.")
    if config.pos_encoder == "sinusoidal" and config.model_dim % 2:
        problems.append(f"`pos_encoder=sinusoidal` needs an even `model_dim`, but it is {config.model_dim}.")
    return problems


def validation(config: Any, *, causal: bool) -> ValidationResult:
    """A model config's ``validate``: its :meth:`structural_problems` and, with a valid width, our registry's
    messages on a bad mixer (``causal``: the decoder's)."""
    result = ValidationResult()
    for problem in config.structural_problems():
        result.add_error(problem)
    if config.model_dim >= 1:
        for problem in mixer_problems(config.mixer, config.mixer_options, dim=config.model_dim,
                                      host_options=config.host_options(), causal=causal):
            result.add_error(problem)
    return result


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


def register_mixer_encoder_archs(container: DependencyContainer) -> None:
    """Register the presets of the ``mixer_encoder`` family.

    Generic presets keep ``mixer="attention"`` and no mixer options, so ``--config
    model.config_overrides.mixer=NAME`` gives that mixer with its own defaults; paper presets pin a mixer.
    """
    arch = ConfigRegistrar(container, MixerEncoderConfig)

    @arch("tiny")
    def tiny() -> MixerEncoderConfig:
        # Tests and smoke runs: a few thousand parameters, byte-level vocabulary.
        return MixerEncoderConfig(
            model_dim=32, num_layers=2, num_heads=4, ffn_inner_dim=64, vocab_size=BYTE_VOCAB_SIZE,
            max_seq_len=128, dropout_p=0.0,
        )

    @arch("small")
    def small() -> MixerEncoderConfig:
        # Trains on a laptop CPU in minutes on the recipe's corpus; byte-level vocabulary.
        return MixerEncoderConfig(
            model_dim=256, num_layers=4, num_heads=4, ffn_inner_dim=1024, vocab_size=BYTE_VOCAB_SIZE,
            max_seq_len=512, dropout_p=0.1,
        )

    @arch("base")
    def base() -> MixerEncoderConfig:
        # BERT-base shape: 12 post-norm layers, 768 wide, 12 heads, GELU FFN 3072, embedding layer norm.
        return MixerEncoderConfig(
            model_dim=768, num_layers=12, num_heads=12, ffn_inner_dim=3072, vocab_size=BERT_VOCAB_SIZE,
            max_seq_len=512, pos_encoder="learned", embed_layer_norm=True, norm_order=TransformerNormOrder.POST,
            layer_norm_eps=1e-12, dropout_p=0.1,
        )

    @arch("base_hydra")
    def base_hydra() -> MixerEncoderConfig:
        # Hydra BERT (Hwang et al. 2024, Table 4): 23 post-norm layers of the quasiseparable mixer alone (no
        # FFN: the gated, expanded mixer block is the channel mixer too), width 768, no position
        # embeddings, embedding layer norm. The mixer keeps its own (paper) defaults: num_heads=None.
        return MixerEncoderConfig(
            model_dim=768, num_layers=23, num_heads=None, ffn_inner_dim=0, vocab_size=BERT_VOCAB_SIZE,
            max_seq_len=512, pos_encoder="none", embed_layer_norm=True, norm_order=TransformerNormOrder.POST,
            layer_norm_eps=1e-5, dropout_p=0.1, mixer="quasiseparable",
        )
