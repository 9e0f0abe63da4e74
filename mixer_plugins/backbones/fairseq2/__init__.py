"""fairseq2 adapter: any registered mixer as the self-attention of fairseq2 encoders, chosen by config.

fairseq2 imports this package through our ``fairseq2.extension`` entry point and calls
:func:`setup_fairseq2_extension`, which registers

* the ``mixer_encoder`` model family (BERT-like encoder-only model: embeddings, a
  ``StandardTransformerEncoder`` whose self-attention is the mixer named by ``config.mixer``, an MLM head and
  a sequence-classification head) with archs ``tiny``, ``small``, ``base`` and ``base_hydra``;
* the ``mixer_decoder`` family: a decoder-only language model (fairseq2's ``TransformerLM``) whose
  self-attention is any causal mixer, with archs ``tiny``, ``small`` and ``base`` (GPT-2 small's shape); it
  generates with fairseq2's own sequence generators, incremental decoding running on the mixers' caches;
* the ``nllb_mixer`` family: fairseq2's NLLB with its encoder self-attention (``mixer``) and its decoder
  self-attention (``decoder_mixer``) swapped by config (upstream NLLB exactly when both are ``"attention"``).

Swapping the mixer is one config field::

    from dataclasses import replace
    from fairseq2 import init_fairseq2
    from mixer_plugins.backbones.fairseq2 import get_mixer_encoder_hub

    init_fairseq2()
    hub = get_mixer_encoder_hub()
    model = hub.create_new_model(replace(hub.get_arch_config("tiny"), mixer="ema"))

and in a recipe: ``python -m mixer_plugins.backbones.fairseq2 OUT --config model.config_overrides.mixer=quasi``.

``import mixer_plugins`` never imports this package (fairseq2 is an optional extra).
"""

# ruff: noqa: E402  (the extra is checked before fairseq2 is imported)
from __future__ import annotations

from ..._extras import require_extra

require_extra("fairseq2", "fairseq2", "mixer_plugins.backbones.fairseq2")  # one line, not a traceback

from fairseq2.composition import register_model_family
from fairseq2.models import ModelFamily
from fairseq2.models.transformer_lm import (
    TransformerLM,
    apply_ac_to_transformer_lm,
    apply_fsdp_to_transformer_lm,
    compile_transformer_lm,
)
from fairseq2.runtime.dependency import DependencyContainer

from .attention import MixerAttention, MixerDecodingState, RecomputeState, padding_mask, unpack_layout
from .checkpoint import load_mixer_checkpoint, with_mixer_records
from .config import (
    BERT_VOCAB_SIZE,
    BYTE_VOCAB_SIZE,
    MIXER_ENCODER_FAMILY,
    MixerEncoderConfig,
    register_mixer_encoder_archs,
)
from .decoder import (
    GPT2_VOCAB_SIZE,
    MIXER_DECODER_FAMILY,
    MixerDecoderConfig,
    create_mixer_decoder_model,
    get_mixer_decoder_hub,
    register_mixer_decoder_archs,
)
from .model import (
    MixerEncoderModel,
    apply_ac_to_mixer_encoder,
    apply_fsdp_to_mixer_encoder,
    create_mixer_encoder_model,
    get_mixer_encoder_hub,
)
from .nllb import (
    NLLB_MIXER_FAMILY,
    NllbMixerConfig,
    NllbMixerFactory,
    create_nllb_mixer_model,
    get_nllb_mixer_hub,
    register_nllb_mixer_family,
)
from .options import ResolvedMixer, mixer_problems, resolve_mixer

__all__ = [
    "setup_fairseq2_extension",
    "MIXER_DECODER_FAMILY",
    "MIXER_ENCODER_FAMILY",
    "NLLB_MIXER_FAMILY",
    "BYTE_VOCAB_SIZE",
    "BERT_VOCAB_SIZE",
    "GPT2_VOCAB_SIZE",
    "MixerAttention",
    "MixerDecoderConfig",
    "MixerDecodingState",
    "MixerEncoderConfig",
    "MixerEncoderModel",
    "NllbMixerConfig",
    "NllbMixerFactory",
    "RecomputeState",
    "ResolvedMixer",
    "create_mixer_decoder_model",
    "create_mixer_encoder_model",
    "create_nllb_mixer_model",
    "get_mixer_decoder_hub",
    "get_mixer_encoder_hub",
    "get_nllb_mixer_hub",
    "load_mixer_checkpoint",
    "mixer_problems",
    "padding_mask",
    "resolve_mixer",
    "unpack_layout",
]


def setup_fairseq2_extension(container: DependencyContainer) -> None:
    """fairseq2 extension entry point: register the ``mixer_encoder``, ``mixer_decoder`` and ``nllb_mixer``
    families.

    Idempotent: a family already in ``container`` is skipped, so passing this function as
    ``init_fairseq2(extras=...)`` while the entry point also runs is harmless. It only registers providers
    (cheap, no side effects): it runs in every fairseq2 process once mixer-plugins is installed.
    """
    registered = set(container.iter_keys(ModelFamily))  # iter_keys does not freeze the container
    if MIXER_ENCODER_FAMILY not in registered:
        register_model_family(
            container,
            MIXER_ENCODER_FAMILY,
            kls=MixerEncoderModel,
            config_kls=MixerEncoderConfig,
            factory=create_mixer_encoder_model,
            state_dict_converter=with_mixer_records(create_mixer_encoder_model),
            fsdp_applier=apply_fsdp_to_mixer_encoder,
            layerwise_ac_applier=apply_ac_to_mixer_encoder,
        )
        register_mixer_encoder_archs(container)
    if MIXER_DECODER_FAMILY not in registered:
        register_model_family(
            container,
            MIXER_DECODER_FAMILY,
            kls=TransformerLM,
            config_kls=MixerDecoderConfig,
            factory=create_mixer_decoder_model,
            state_dict_converter=with_mixer_records(create_mixer_decoder_model),
            compiler=compile_transformer_lm,
            fsdp_applier=apply_fsdp_to_transformer_lm,
            layerwise_ac_applier=apply_ac_to_transformer_lm,
        )
        register_mixer_decoder_archs(container)
    if NLLB_MIXER_FAMILY not in registered:
        register_nllb_mixer_family(container)
