"""The ``mixer_decoder`` model family: a decoder-only language model whose self-attention is any causal mixer.

The model is fairseq2's own :class:`~fairseq2.models.transformer_lm.TransformerLM` (token embedding and position
encoder, ``StandardTransformerLMDecoder`` layers, a final projection tied to the embedding table), with each layer's
self-attention a :class:`~mixer_plugins.backbones.fairseq2.attention.MixerAttention` of the mixer named by
``config.mixer``, in its causal form. So everything fairseq2 does with a language model works with it: the loss, the
recipes' machinery, and generation with fairseq2's own sequence generators (``SamplingSequenceGenerator``,
``BeamSearchSequenceGenerator``), whose incremental decoding (``IncrementalStateBag``) runs on the mixers' caches
(:meth:`~mixer_plugins.MatrixMixer.step`): constant work per token for ``semiseparable``, ``low_rank`` or
``sliding_window_attention``, a KV cache for attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from fairseq2.error import NotSupportedError
from fairseq2.models import ModelHubAccessor
from fairseq2.models.transformer import (
    StandardFeedForwardNetwork,
    TransformerEmbeddingFrontend,
    TransformerNormOrder,
)
from fairseq2.models.transformer_lm import (
    StandardTransformerLMDecoder,
    StandardTransformerLMDecoderLayer,
    TransformerLM,
)
from fairseq2.nn import (
    LearnedPositionEncoder,
    Linear,
    PositionEncoder,
    Projection,
    SinusoidalPositionEncoder,
    StandardEmbedding,
    StandardLayerNorm,
    TiedProjection,
    init_scaled_embedding,
)
from fairseq2.runtime.config_registry import ConfigRegistrar
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.utils.validation import ValidationResult
from torch.nn import GELU

from .attention import MixerAttention
from .config import BYTE_VOCAB_SIZE, common_problems, validation
from .options import ResolvedMixer, resolve_mixer

__all__ = [
    "GPT2_VOCAB_SIZE",
    "MIXER_DECODER_FAMILY",
    "MixerDecoderConfig",
    "create_mixer_decoder_model",
    "get_mixer_decoder_hub",
    "register_mixer_decoder_archs",
]

MIXER_DECODER_FAMILY: Final = "mixer_decoder"

#: GPT-2's BPE vocabulary rounded up to a multiple of 64 (the ``base`` arch's size).
GPT2_VOCAB_SIZE: Final = 50_304


@dataclass(kw_only=True)
class MixerDecoderConfig:
    """A decoder-only language model (GPT-like, pre-norm by default) whose token mixer is any causal mixer.

    Layer ``i`` is ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``; mixers that can run either way get
    ``causal=True``, and a mixer without a causal form is a config error.
    """

    model_dim: int = 768
    """Width of the model (the mixer's ``dim``)."""

    num_layers: int = 12
    """Number of decoder layers."""

    num_heads: int | None = 12
    """Given to mixers that have a ``num_heads`` option unless set under ``mixer_options``; ``None``: the mixer's
    own default."""

    ffn_inner_dim: int = 3072
    """Inner width of the feed-forward block (GELU)."""

    vocab_size: int = GPT2_VOCAB_SIZE
    """Size of the token vocabulary."""

    pad_idx: int = 0
    """Index of the padding token (never predicted; ignored by the loss)."""

    max_seq_len: int = 1024
    """Longest sequence (prompt and generated tokens): sizes the position table and the generators' limit, and is
    given to mixers that have a ``max_seq_len`` option unless set under ``mixer_options``."""

    pos_encoder: Literal["learned", "sinusoidal", "none"] = "learned"
    """Absolute position encoding added to the token embeddings; ``none`` leaves order to the mixer (a causal
    mixer sees order by itself)."""

    norm_order: TransformerNormOrder = TransformerNormOrder.PRE
    """``PRE`` (default) or ``POST``; given by name on the command line."""

    layer_norm_eps: float = 1e-5
    """Epsilon of every layer norm."""

    dropout_p: float = 0.1
    """Dropout on the embeddings and on the outputs of the mixer and feed-forward blocks."""

    tie_embeddings: bool = True
    """The output projection is the embedding table itself (no parameters of its own)."""

    mixer: str = "attention"
    """The token mixer: any registered name or alias with a causal form (``mixer-plugins list``)."""

    mixer_options: dict[str, object] = field(default_factory=dict)
    """Options per mixer name, e.g. ``{"semiseparable": {"d_state": 32}}``; only ``mixer``'s entry is used."""

    def host_options(self) -> dict[str, int | None]:
        """Options the model supplies to mixers that have them (unless set under ``mixer_options``)."""
        return {"num_heads": self.num_heads, "max_seq_len": self.max_seq_len}

    def resolve_mixer(self) -> ResolvedMixer:
        """The chosen mixer's spec and validated (causal) config; raises our registry errors when invalid."""
        return resolve_mixer(self.mixer, self.mixer_options, dim=self.model_dim, host_options=self.host_options(),
                             causal=True)

    def structural_problems(self) -> list[str]:
        """Problems with the non-mixer fields (sizes, probabilities), as messages."""
        return common_problems(self, ("model_dim", "num_layers", "vocab_size", "max_seq_len", "ffn_inner_dim"))

    def validate(self) -> ValidationResult:
        """Called by fairseq2 on asset-card and recipe configs: our registry's messages on a bad mixer."""
        return validation(self, causal=True)


def _layer_norm(config: MixerDecoderConfig) -> StandardLayerNorm:
    return StandardLayerNorm(config.model_dim, bias=True, eps=config.layer_norm_eps)


def create_mixer_decoder_model(config: MixerDecoderConfig) -> TransformerLM:
    """The family factory. Validates first, so a bad mixer name or option (or a mixer without a causal form)
    raises our registry error before anything is built."""
    if not isinstance(config, MixerDecoderConfig):
        raise TypeError(f"expected a MixerDecoderConfig, got {type(config).__name__}")
    problems = config.structural_problems()
    if problems:
        raise ValueError("invalid mixer_decoder config: " + " ".join(problems))
    resolved = config.resolve_mixer()

    embed = StandardEmbedding(config.vocab_size, config.model_dim, config.pad_idx, init_fn=init_scaled_embedding)
    pos_encoder: PositionEncoder | None
    if config.pos_encoder == "learned":
        pos_encoder = LearnedPositionEncoder(config.model_dim, config.max_seq_len)
    elif config.pos_encoder == "sinusoidal":
        pos_encoder = SinusoidalPositionEncoder(config.model_dim, config.max_seq_len)
    else:
        pos_encoder = None
    frontend = TransformerEmbeddingFrontend(config.model_dim, embed, pos_encoder, dropout_p=config.dropout_p)
    layers = []
    for _ in range(config.num_layers):
        ffn = StandardFeedForwardNetwork(config.model_dim, config.ffn_inner_dim, bias=True,
                                         inner_activation=GELU())
        layers.append(StandardTransformerLMDecoderLayer(
            MixerAttention(resolved), _layer_norm(config), ffn, _layer_norm(config),
            norm_order=config.norm_order, dropout_p=config.dropout_p,
        ))
    final_norm = _layer_norm(config) if config.norm_order != TransformerNormOrder.POST else None
    decoder = StandardTransformerLMDecoder(layers, final_norm)
    final_proj: Projection
    if config.tie_embeddings:
        final_proj = TiedProjection(embed.weight, bias=None)
    else:
        final_proj = Linear(config.model_dim, config.vocab_size, bias=False)
    return TransformerLM(config.model_dim, frontend, decoder, final_proj, config.pad_idx, config.max_seq_len)


def decoder_mixers(model: TransformerLM) -> list[MixerAttention]:
    """The mixer of each layer of a ``mixer_decoder`` model."""
    found = [layer.self_attn for layer in model.decoder.layers]
    if not all(isinstance(m, MixerAttention) for m in found):
        raise NotSupportedError("not a mixer_decoder model: its layers' self-attention are not mixers")
    return found  # type: ignore[return-value]


def register_mixer_decoder_archs(container: DependencyContainer) -> None:
    """Register the presets of the ``mixer_decoder`` family: ``tiny`` (tests), ``small`` (a CPU run), ``base``
    (GPT-2 small's shape, about 124M parameters with attention). All keep ``mixer="attention"``; flip it with
    ``--config model.config_overrides.mixer=NAME``."""
    arch = ConfigRegistrar(container, MixerDecoderConfig)

    @arch("tiny")
    def tiny() -> MixerDecoderConfig:
        # Tests and smoke runs: a few tens of thousands of parameters, byte-level vocabulary.
        return MixerDecoderConfig(model_dim=32, num_layers=2, num_heads=4, ffn_inner_dim=64,
                                  vocab_size=BYTE_VOCAB_SIZE, max_seq_len=128, dropout_p=0.0)

    @arch("small")
    def small() -> MixerDecoderConfig:
        # Learns the bundled corpus on a CPU in minutes; byte-level vocabulary.
        return MixerDecoderConfig(model_dim=256, num_layers=4, num_heads=4, ffn_inner_dim=1024,
                                  vocab_size=BYTE_VOCAB_SIZE, max_seq_len=512, dropout_p=0.1)

    @arch("base")
    def base() -> MixerDecoderConfig:
        # GPT-2 small's shape: 12 pre-norm layers, 768 wide, 12 heads, GELU FFN 3072, 1024 positions, tied
        # embeddings over a 50,304-token vocabulary (about 124M parameters with attention).
        return MixerDecoderConfig(model_dim=768, num_layers=12, num_heads=12, ffn_inner_dim=3072,
                                  vocab_size=GPT2_VOCAB_SIZE, max_seq_len=1024, dropout_p=0.1)


#: Typed access to the family: ``get_mixer_decoder_hub().create_new_model(config)``, ``.get_arch_config("tiny")``.
get_mixer_decoder_hub = ModelHubAccessor(MIXER_DECODER_FAMILY, TransformerLM, MixerDecoderConfig)
