"""The ``mixer_decoder`` model family: a decoder-only language model whose self-attention is any causal mixer.

The model is fairseq2's own :class:`~fairseq2.models.transformer_lm.TransformerLM`, each layer's self-attention a
:class:`~mixer_plugins.backbones.fairseq2.attention.MixerAttention` of ``config.mixer`` in its causal form, so
fairseq2's loss, recipes and sequence generators work with it; their incremental decoding runs on the mixers' caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from fairseq2.models import ModelHubAccessor
from fairseq2.models.transformer import TransformerEmbeddingFrontend
from fairseq2.models.transformer_lm import (
    StandardTransformerLMDecoder,
    StandardTransformerLMDecoderLayer,
    TransformerLM,
    apply_ac_to_transformer_lm,
    apply_fsdp_to_transformer_lm,
    compile_transformer_lm,
)
from fairseq2.nn import Linear, Projection, TiedProjection

from .attention import MixerAttention
from .family import (
    SMALL_ARCH,
    TINY_ARCH,
    MixerFamily,
    MixerModelConfig,
    build_embedding,
    build_ffn,
    build_final_norm,
    build_layer_norm,
    checked_mixer,
)

__all__ = ["DECODER_FAMILY", "GPT2_VOCAB_SIZE", "MIXER_DECODER_FAMILY", "MixerDecoderConfig",
           "create_mixer_decoder_model", "get_mixer_decoder_hub"]

MIXER_DECODER_FAMILY: Final = "mixer_decoder"

#: GPT-2's BPE vocabulary rounded up to a multiple of 64 (the ``base`` arch's size).
GPT2_VOCAB_SIZE: Final = 50_304


@dataclass(kw_only=True)
class MixerDecoderConfig(MixerModelConfig):
    """A decoder-only language model (GPT-like, pre-norm by default) whose token mixer is any causal mixer: mixers
    that can run either way get ``causal=True``, and a mixer without a causal form is a config error."""

    causal = True

    vocab_size: int = GPT2_VOCAB_SIZE
    """Size of the token vocabulary (``pad_idx`` is never predicted and ignored by the loss)."""

    max_seq_len: int = 1024
    """Longest sequence (prompt and generated tokens): sizes the position table and the generators' limit, and is
    given to mixers that have a ``max_seq_len`` option unless set under ``mixer_options``."""

    tie_embeddings: bool = True
    """The output projection is the embedding table itself (no parameters of its own)."""


def create_mixer_decoder_model(config: MixerDecoderConfig) -> TransformerLM:
    """The family factory; validates first (:func:`~.family.checked_mixer`), so a mixer without a causal form is our
    registry's error before anything is built."""
    resolved = checked_mixer(config, MixerDecoderConfig, MIXER_DECODER_FAMILY)
    embed, pos_encoder = build_embedding(config)
    frontend = TransformerEmbeddingFrontend(config.model_dim, embed, pos_encoder, dropout_p=config.dropout_p)
    layers = []
    for _ in range(config.num_layers):
        ffn = build_ffn(config)  # before the mixer: the order in which the random initialisation is drawn
        layers.append(StandardTransformerLMDecoderLayer(MixerAttention(resolved), build_layer_norm(config), ffn,
                                                        build_layer_norm(config), norm_order=config.norm_order,
                                                        dropout_p=config.dropout_p))
    decoder = StandardTransformerLMDecoder(layers, build_final_norm(config))
    final_proj: Projection
    if config.tie_embeddings:
        final_proj = TiedProjection(embed.weight, bias=None)
    else:
        final_proj = Linear(config.model_dim, config.vocab_size, bias=False)
    return TransformerLM(config.model_dim, frontend, decoder, final_proj, config.pad_idx, config.max_seq_len)


#: The family our extension entry point registers; every preset keeps ``mixer="attention"`` (flip it with
#: ``--config model.config_overrides.mixer=NAME``).
DECODER_FAMILY = MixerFamily(
    MIXER_DECODER_FAMILY, TransformerLM, MixerDecoderConfig, create_mixer_decoder_model,
    archs={
        "tiny": TINY_ARCH,
        "small": SMALL_ARCH,
        # GPT-2 small's shape: 12 pre-norm layers, 768 wide, 12 heads, GELU FFN 3072, 1024 positions, tied
        # embeddings over a 50,304-token vocabulary (about 124M parameters with attention).
        "base": dict(model_dim=768, num_layers=12, num_heads=12, ffn_inner_dim=3072, vocab_size=GPT2_VOCAB_SIZE,
                     max_seq_len=1024, dropout_p=0.1),
    },
    compiler=compile_transformer_lm, fsdp_applier=apply_fsdp_to_transformer_lm,
    layerwise_ac_applier=apply_ac_to_transformer_lm,
)

#: Typed access to the family: ``get_mixer_decoder_hub().create_new_model(config)``, ``.get_arch_config("tiny")``.
get_mixer_decoder_hub = ModelHubAccessor(MIXER_DECODER_FAMILY, TransformerLM, MixerDecoderConfig)
