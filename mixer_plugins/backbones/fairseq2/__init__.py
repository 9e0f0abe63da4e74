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

``import mixer_plugins`` never imports this package (fairseq2 is an optional extra), and importing it imports no
fairseq2 (nor torch): the names below are loaded on first use, so the ``python -m`` commands answer ``--help`` and
argument errors at once. Without fairseq2 installed, importing it fails with one line naming the extra.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ..._extras import require_extra

# Finding fairseq2 imports nothing; when it is not installed, require_extra raises (or, while python -m locates one
# of our modules, exits 2) with one line naming the extra, not a traceback.
if importlib.util.find_spec("fairseq2") is None:
    require_extra("fairseq2", "fairseq2", __name__)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from fairseq2.runtime.dependency import DependencyContainer

    from .attention import MixerAttention, MixerDecodingState, RecomputeState, padding_mask, unpack_layout
    from .checkpoint import load_mixer_checkpoint
    from .decoder import (
        GPT2_VOCAB_SIZE,
        MIXER_DECODER_FAMILY,
        MixerDecoderConfig,
        create_mixer_decoder_model,
        get_mixer_decoder_hub,
    )
    from .encoder import (
        BERT_VOCAB_SIZE,
        MIXER_ENCODER_FAMILY,
        MixerEncoderConfig,
        MixerEncoderModel,
        create_mixer_encoder_model,
        get_mixer_encoder_hub,
    )
    from .family import BYTE_VOCAB_SIZE, MixerFamily, MixerModelConfig
    from .nllb import NLLB_MIXER_FAMILY, NllbMixerConfig, NllbMixerFactory, create_nllb_mixer_model, get_nllb_mixer_hub
    from .options import ResolvedMixer, mixer_problems, resolve_mixer

#: public name -> the module of this package that defines it (imported on first access)
_LAZY: dict[str, str] = {name: module for module, names in {
    "attention": ("MixerAttention", "MixerDecodingState", "RecomputeState", "padding_mask", "unpack_layout"),
    "checkpoint": ("load_mixer_checkpoint",),
    "encoder": ("BERT_VOCAB_SIZE", "MIXER_ENCODER_FAMILY", "MixerEncoderConfig", "MixerEncoderModel",
                "create_mixer_encoder_model", "get_mixer_encoder_hub"),
    "family": ("BYTE_VOCAB_SIZE", "MixerFamily", "MixerModelConfig"),
    "decoder": ("GPT2_VOCAB_SIZE", "MIXER_DECODER_FAMILY", "MixerDecoderConfig", "create_mixer_decoder_model",
                "get_mixer_decoder_hub"),
    "nllb": ("NLLB_MIXER_FAMILY", "NllbMixerConfig", "NllbMixerFactory", "create_nllb_mixer_model",
             "get_nllb_mixer_hub"),
    "options": ("ResolvedMixer", "mixer_problems", "resolve_mixer"),
}.items() for name in names}

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
    "MixerFamily",
    "MixerModelConfig",
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
    from fairseq2.models import ModelFamily

    from .decoder import DECODER_FAMILY
    from .encoder import ENCODER_FAMILY
    from .nllb import NLLB_FAMILY

    registered = set(container.iter_keys(ModelFamily))  # iter_keys does not freeze the container
    for family in (ENCODER_FAMILY, DECODER_FAMILY, NLLB_FAMILY):
        if family.name not in registered:
            family.register(container)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
