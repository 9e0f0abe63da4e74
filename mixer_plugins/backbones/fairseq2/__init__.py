"""fairseq2 adapter: any registered mixer as the self-attention of fairseq2 encoders, chosen by config.

fairseq2 imports this package through our ``fairseq2.extension`` entry point and calls
:func:`setup_fairseq2_extension`, which registers

* the ``mixer_encoder`` model family (BERT-like encoder-only model: embeddings, a
  ``StandardTransformerEncoder`` whose self-attention is the mixer named by ``config.mixer``, an MLM head and
  a sequence-classification head) with archs ``tiny``, ``small``, ``base`` and ``base_hydra``;
* the ``nllb_mixer`` family: fairseq2's NLLB with its encoder self-attention swapped by the same two fields
  (upstream NLLB exactly when ``mixer="attention"``).

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
from fairseq2.runtime.dependency import DependencyContainer

from .attention import MixerAttention, padding_mask, unpack_layout
from .checkpoint import load_mixer_checkpoint, with_mixer_records
from .config import (
    BERT_VOCAB_SIZE,
    BYTE_VOCAB_SIZE,
    MIXER_ENCODER_FAMILY,
    MixerEncoderConfig,
    register_mixer_encoder_archs,
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
    "MIXER_ENCODER_FAMILY",
    "NLLB_MIXER_FAMILY",
    "BYTE_VOCAB_SIZE",
    "BERT_VOCAB_SIZE",
    "MixerAttention",
    "MixerEncoderConfig",
    "MixerEncoderModel",
    "NllbMixerConfig",
    "NllbMixerFactory",
    "ResolvedMixer",
    "create_mixer_encoder_model",
    "create_nllb_mixer_model",
    "get_mixer_encoder_hub",
    "get_nllb_mixer_hub",
    "load_mixer_checkpoint",
    "mixer_problems",
    "padding_mask",
    "resolve_mixer",
    "unpack_layout",
]


def setup_fairseq2_extension(container: DependencyContainer) -> None:
    """fairseq2 extension entry point: register the ``mixer_encoder`` and ``nllb_mixer`` families.

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
    if NLLB_MIXER_FAMILY not in registered:
        register_nllb_mixer_family(container)
