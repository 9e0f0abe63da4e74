"""``nllb_mixer``: fairseq2's NLLB encoder-decoder with its encoder and decoder self-attention swapped by config.

An existing fairseq2 family cannot gain a field, so this is a new family: its config subclasses ``NllbConfig`` with
``mixer``/``mixer_options`` (encoder) and ``decoder_mixer``/``decoder_mixer_options`` (decoder, causal), its factory
subclasses ``NllbFactory``, and every NLLB arch is re-exposed under it. With both mixers ``attention`` it is upstream
NLLB exactly (same modules, parameter names and initialisation), so NLLB checkpoints load unchanged. The
cross-attention is left alone. See docs/fairseq2.md, "The NLLB wrapper".
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Final, Literal

from fairseq2.models import ModelHubAccessor
from fairseq2.models.nllb import NllbConfig, NllbFactory, convert_nllb_state_dict
from fairseq2.models.transformer import (
    MultiheadAttention,
    TransformerModel,
    apply_ac_to_transformer,
    apply_fsdp_to_transformer,
)
from fairseq2.runtime.dependency import DependencyContainer, DependencyResolver
from fairseq2.utils.validation import ValidationResult

from mixer_plugins.registry import InvalidMixerOptions, MixerError, default_registry

from .attention import MixerAttention
from .family import MixerFamily
from .options import ResolvedMixer, namespaced_options, resolve_mixer

__all__ = ["NLLB_FAMILY", "NLLB_MIXER_FAMILY", "NllbMixerConfig", "NllbMixerFactory", "create_nllb_mixer_model",
           "get_nllb_mixer_hub"]

NLLB_MIXER_FAMILY: Final = "nllb_mixer"

#: The name under which the wrapper keeps fairseq2's own attention.
UPSTREAM_MIXER: Final = "attention"


@dataclass(kw_only=True)
class NllbMixerConfig(NllbConfig):
    """:class:`~fairseq2.models.nllb.NllbConfig` plus the mixers of the encoder and decoder self-attention."""

    mixer: str = UPSTREAM_MIXER
    """Encoder self-attention: ``attention`` keeps fairseq2's own (upstream NLLB); any other registered
    mixer replaces it in every encoder layer."""

    mixer_options: dict[str, object] = field(default_factory=dict)
    """Options per mixer name, e.g. ``{"quasi": {"d_state": 32}}``; only ``mixer``'s entry is used."""

    decoder_mixer: str = UPSTREAM_MIXER
    """Decoder self-attention: ``attention`` keeps fairseq2's own; any other registered mixer with a causal form
    replaces it in every decoder layer (in its causal form)."""

    decoder_mixer_options: dict[str, object] = field(default_factory=dict)
    """Options per mixer name for ``decoder_mixer``, e.g. ``{"semiseparable": {"d_state": 32}}``."""

    def is_upstream(self, which: Literal["encoder", "decoder"] = "encoder") -> bool:
        """True when the encoder (``which="decoder"``: the decoder) keeps fairseq2's own attention (its mixer is
        ``attention`` or an alias)."""
        field_name = "mixer" if which == "encoder" else "decoder_mixer"
        name = getattr(self, field_name)
        if not isinstance(name, str) or not name.strip():
            raise MixerError(f"{field_name} must be a non-empty mixer name (see `mixer-plugins list`), got {name!r}")
        return name == UPSTREAM_MIXER or default_registry.get_spec(name).name == UPSTREAM_MIXER

    def resolve_mixer(self, which: Literal["encoder", "decoder"] = "encoder") -> ResolvedMixer | None:
        """The encoder's (``which="decoder"``: the decoder's, causal) replacement mixer, or ``None`` for upstream
        attention; raises our registry errors."""
        prefix = "" if which == "encoder" else "decoder_"
        options = getattr(self, f"{prefix}mixer_options")
        heads = getattr(self, f"num_{which}_attn_heads")
        if self.is_upstream(which):
            # The other namespaces are still checked (names, shapes), like any mixer_options.
            if namespaced_options(default_registry.get_spec(UPSTREAM_MIXER), options or {}):
                raise InvalidMixerOptions(UPSTREAM_MIXER, [
                    f"with {prefix}mixer='attention' the NLLB {which} keeps fairseq2's own attention, configured by "
                    f"NllbConfig (num_{which}_attn_heads); remove {prefix}mixer_options.attention"])
            return None
        return resolve_mixer(getattr(self, f"{prefix}mixer"), options, dim=self.model_dim,
                             host_options={"num_heads": heads, "max_seq_len": self.max_seq_len},
                             causal=which == "decoder")

    def validate(self) -> ValidationResult:
        result = ValidationResult()
        for which in ("encoder", "decoder"):
            try:
                self.resolve_mixer(which)
            except MixerError as err:
                result.add_error(str(err))
        return result


class NllbMixerFactory(NllbFactory):
    """``NllbFactory`` whose encoder and decoder self-attention are the configured mixers."""

    def __init__(self, config: NllbMixerConfig) -> None:
        super().__init__(config)
        self._resolved = config.resolve_mixer()
        self._resolved_decoder = config.resolve_mixer("decoder")

    def create_encoder_self_attention(self) -> MultiheadAttention:
        if self._resolved is None:
            return super().create_encoder_self_attention()
        return MixerAttention(self._resolved)

    def create_decoder_self_attention(self) -> MultiheadAttention:
        if self._resolved_decoder is None:
            return super().create_decoder_self_attention()
        return MixerAttention(self._resolved_decoder)


def create_nllb_mixer_model(config: NllbMixerConfig) -> TransformerModel:
    """The family factory (validates the mixer first: our registry errors, before anything is built)."""
    if not isinstance(config, NllbMixerConfig):
        raise TypeError(f"expected an NllbMixerConfig, got {type(config).__name__}")
    return NllbMixerFactory(config).create_model()


def register_nllb_mixer_archs(container: DependencyContainer) -> None:
    """Re-expose every arch of the ``nllb`` family (``dense_600m``, ...) under ``nllb_mixer``, read from fairseq2's
    own registrations when asked for, so they follow upstream."""
    for arch in list(container.iter_keys(NllbConfig)):
        if not isinstance(arch, str):
            continue

        def provide(resolver: DependencyResolver, arch: str = arch) -> NllbMixerConfig:
            upstream = resolver.resolve(NllbConfig, key=arch)
            return NllbMixerConfig(**{f.name: getattr(upstream, f.name) for f in fields(NllbConfig)})

        container.register(NllbMixerConfig, provide, key=arch)


#: The family our extension entry point registers.
NLLB_FAMILY = MixerFamily(
    NLLB_MIXER_FAMILY, TransformerModel, NllbMixerConfig, create_nllb_mixer_model, converter=convert_nllb_state_dict,
    fsdp_applier=apply_fsdp_to_transformer, layerwise_ac_applier=apply_ac_to_transformer,
    register_more_archs=register_nllb_mixer_archs,
)

#: Typed access: ``get_nllb_mixer_hub().create_new_model(NllbMixerConfig(..., mixer="quasi"))``.
get_nllb_mixer_hub = ModelHubAccessor(NLLB_MIXER_FAMILY, TransformerModel, NllbMixerConfig)
