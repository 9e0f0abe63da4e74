"""The ``mixer_encoder`` model: embeddings, a ``StandardTransformerEncoder`` whose self-attention is any
registered mixer, an MLM head and a sequence-classification head."""

from __future__ import annotations

from typing import Literal

import torch
from fairseq2.error import NotSupportedError
from fairseq2.models import ModelHubAccessor
from fairseq2.models.transformer import (
    AttentionBiasCache,
    StandardFeedForwardNetwork,
    StandardTransformerEncoder,
    StandardTransformerEncoderLayer,
    TransformerEncoderLayer,
    TransformerFrontend,
    TransformerNormOrder,
)
from fairseq2.models.utils.ac import apply_layerwise_ac
from fairseq2.models.utils.fsdp import apply_layerwise_fsdp
from fairseq2.nn import (
    BatchLayout,
    IncrementalStateBag,
    LayerNorm,
    LearnedPositionEncoder,
    Linear,
    PositionEncoder,
    SinusoidalPositionEncoder,
    StandardEmbedding,
    StandardLayerNorm,
    TiedProjection,
    init_scaled_embedding,
)
from fairseq2.nn.fsdp import FSDPWrapper
from fairseq2.nn.functional import cross_entropy
from torch import Tensor
from torch.nn import GELU, Dropout, Module, Parameter

from .attention import MixerAttention, unpack_layout
from .config import MIXER_ENCODER_FAMILY, MixerEncoderConfig
from .options import ResolvedMixer

__all__ = [
    "MixerEncoderFrontend",
    "MixerOnlyEncoderLayer",
    "MlmHead",
    "ClassificationHead",
    "MixerEncoderModel",
    "create_mixer_encoder_model",
    "get_mixer_encoder_hub",
]


class MixerEncoderFrontend(TransformerFrontend):
    """Token embedding (scaled by sqrt(model_dim)), optional position encoding, layer norm and dropout."""

    def __init__(self, embed: StandardEmbedding, pos_encoder: PositionEncoder | None,
                 layer_norm: LayerNorm | None, *, dropout_p: float) -> None:
        super().__init__()
        self.embed = embed
        self.scale = embed.embed_dim ** 0.5
        self.pos_encoder: PositionEncoder | None
        self.register_module("pos_encoder", pos_encoder)
        self.layer_norm: LayerNorm | None
        self.register_module("layer_norm", layer_norm)
        self.dropout: Dropout | None
        self.register_module("dropout", Dropout(dropout_p) if dropout_p > 0 else None)

    def forward(self, seqs: Tensor, seqs_layout: BatchLayout, *,
                state_bag: IncrementalStateBag | None = None) -> tuple[Tensor, BatchLayout]:
        if state_bag is not None:
            raise NotSupportedError("the mixer_encoder front-end is encoder-only: state_bag is not supported")
        x = self.embed(seqs) * self.scale
        if self.pos_encoder is not None:
            x = self.pos_encoder(x, seqs_layout)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        if self.dropout is not None:
            x = self.dropout(x)
        return x, seqs_layout


class MixerOnlyEncoderLayer(TransformerEncoderLayer):
    """An encoder layer without feed-forward block: ``x + mixer(norm(x))`` (pre-norm) or
    ``norm(x + mixer(x))`` (post-norm), as in the Hydra BERT, whose gated mixer is its own channel mixer."""

    def __init__(self, self_attn: MixerAttention, self_attn_layer_norm: LayerNorm, *,
                 norm_order: TransformerNormOrder, dropout_p: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.self_attn_layer_norm = self_attn_layer_norm
        self.self_attn_dropout: Dropout | None
        self.register_module("self_attn_dropout", Dropout(dropout_p) if dropout_p > 0 else None)
        self.norm_order = norm_order

    def forward(self, seqs: Tensor, seqs_layout: BatchLayout, attn_bias_cache: AttentionBiasCache) -> Tensor:
        residual = seqs
        if self.norm_order != TransformerNormOrder.POST:
            seqs = self.self_attn_layer_norm(seqs)
        seqs = self.self_attn(seqs, seqs_layout, keys=seqs, keys_layout=seqs_layout, values=seqs,
                              bias_cache=attn_bias_cache)
        if self.self_attn_dropout is not None:
            seqs = self.self_attn_dropout(seqs)
        seqs = seqs + residual
        if self.norm_order == TransformerNormOrder.POST:
            seqs = self.self_attn_layer_norm(seqs)
        return seqs

    def extra_repr(self) -> str:
        return f"norm_order={self.norm_order.name}"


class MlmHead(Module):
    """BERT's MLM head: dense + GELU + layer norm, then the embedding table (tied) plus a bias."""

    def __init__(self, model_dim: int, embed: StandardEmbedding, *, layer_norm_eps: float) -> None:
        super().__init__()
        self.dense = Linear(model_dim, model_dim, bias=True)
        self.activation = GELU()
        self.layer_norm = StandardLayerNorm(model_dim, bias=True, eps=layer_norm_eps)
        # The output weight is the embedding table itself; the bias is the head's own.
        self.decoder = TiedProjection(embed.weight, Parameter(torch.zeros(embed.num_embeddings)))

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.layer_norm(self.activation(self.dense(hidden))))


class ClassificationHead(Module):
    """Pool each sequence (first token or mean of real tokens), then dense + tanh + dropout + linear."""

    def __init__(self, model_dim: int, num_classes: int, *, pooling: Literal["cls", "mean"],
                 dropout_p: float) -> None:
        super().__init__()
        self.pooling = pooling
        self.dense = Linear(model_dim, model_dim, bias=True)
        self.dropout: Dropout | None
        self.register_module("dropout", Dropout(dropout_p) if dropout_p > 0 else None)
        self.out_proj = Linear(model_dim, num_classes, bias=True)

    def pool(self, hidden: Tensor, seqs_layout: BatchLayout) -> Tensor:
        """(N, model_dim): one vector per sequence, padding and packing taken into account."""
        if seqs_layout.packed:
            index, mask = unpack_layout(seqs_layout, hidden.device)
            hidden = hidden[index]
        else:
            mask = seqs_layout.position_indices >= 0
        if self.pooling == "cls":
            return hidden[:, 0]
        weights = mask.to(hidden.dtype)[..., None]
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1)

    def forward(self, hidden: Tensor, seqs_layout: BatchLayout) -> Tensor:
        pooled = torch.tanh(self.dense(self.pool(hidden, seqs_layout)))
        if self.dropout is not None:
            pooled = self.dropout(pooled)
        return self.out_proj(pooled)


class MixerEncoderModel(Module):
    """Encoder-only model of the ``mixer_encoder`` family.

    * ``encode(seqs, layout)`` -> hidden states (N, S, model_dim) (or (T, model_dim) when packed);
    * ``forward(seqs, layout)`` -> MLM logits over the vocabulary at every position;
      ``forward(seqs, layout, targets, target_mask=...)`` -> the MLM cross-entropy over the masked positions
      (logits are computed only there);
    * ``classify(seqs, layout)`` -> (N, num_classes) sequence-classification logits (``num_classes > 0``).
    """

    def __init__(self, config: MixerEncoderConfig, encoder_frontend: MixerEncoderFrontend,
                 encoder: StandardTransformerEncoder, mlm_head: MlmHead,
                 classifier: ClassificationHead | None) -> None:
        super().__init__()
        self.model_dim = config.model_dim
        self.vocab_size = config.vocab_size
        self.pad_idx = config.pad_idx
        self.max_seq_len = config.max_seq_len
        self.mixer_name = config.mixer
        self.encoder_frontend = encoder_frontend
        self.encoder = encoder
        self.mlm_head = mlm_head
        self.classifier: ClassificationHead | None
        self.register_module("classifier", classifier)

    def encode(self, seqs: Tensor, seqs_layout: BatchLayout) -> Tensor:
        """Hidden states of the last layer."""
        x, layout = self.encoder_frontend(seqs, seqs_layout)
        return self.encoder(x, layout)

    def forward(self, seqs: Tensor, seqs_layout: BatchLayout, targets: Tensor | None = None, *,
                target_mask: Tensor | None = None,
                reduction: Literal["sum", "mean"] = "sum") -> Tensor:
        """MLM logits, or with ``targets`` the MLM loss over ``target_mask`` (default: every real token)."""
        hidden = self.encode(seqs, seqs_layout)
        if targets is None:
            return self.mlm_head(hidden)
        if target_mask is None:
            target_mask = seqs_layout.position_indices >= 0
        if targets.shape != target_mask.shape or target_mask.shape != hidden.shape[:-1]:
            raise ValueError(
                f"targets {tuple(targets.shape)} and target_mask {tuple(target_mask.shape)} must both have the "
                f"shape of the token batch {tuple(hidden.shape[:-1])}"
            )
        logits = self.mlm_head(hidden[target_mask])
        return cross_entropy(logits, targets[target_mask], None, reduction=reduction)

    def classify(self, seqs: Tensor, seqs_layout: BatchLayout) -> Tensor:
        """Sequence-classification logits (N, num_classes)."""
        if self.classifier is None:
            raise NotSupportedError(
                "this model has no classification head; build it with num_classes > 0 "
                "(e.g. --config model.config_overrides.num_classes=2)"
            )
        return self.classifier(self.encode(seqs, seqs_layout), seqs_layout)


def _layer_norm(config: MixerEncoderConfig) -> StandardLayerNorm:
    return StandardLayerNorm(config.model_dim, bias=True, eps=config.layer_norm_eps)


def _encoder_layer(config: MixerEncoderConfig, resolved: ResolvedMixer) -> TransformerEncoderLayer:
    self_attn = MixerAttention(resolved)
    if config.ffn_inner_dim == 0:
        return MixerOnlyEncoderLayer(self_attn, _layer_norm(config), norm_order=config.norm_order,
                                     dropout_p=config.dropout_p)
    ffn = StandardFeedForwardNetwork(config.model_dim, config.ffn_inner_dim, bias=True, inner_activation=GELU())
    return StandardTransformerEncoderLayer(
        self_attn, _layer_norm(config), ffn, _layer_norm(config),
        norm_order=config.norm_order, dropout_p=config.dropout_p,
    )


def create_mixer_encoder_model(config: MixerEncoderConfig) -> MixerEncoderModel:
    """The family factory. Validates first, so a bad mixer name or option raises our registry error
    (``UnknownMixerError``, ``InvalidMixerOptions``) before anything is built — also on paths where fairseq2
    does not validate (``hub.create_new_model``)."""
    if not isinstance(config, MixerEncoderConfig):
        raise TypeError(f"expected a MixerEncoderConfig, got {type(config).__name__}")
    problems = config.structural_problems()
    if problems:
        raise ValueError("invalid mixer_encoder config: " + " ".join(problems))
    resolved = config.resolve_mixer()

    embed = StandardEmbedding(config.vocab_size, config.model_dim, config.pad_idx, init_fn=init_scaled_embedding)
    pos_encoder: PositionEncoder | None
    if config.pos_encoder == "learned":
        pos_encoder = LearnedPositionEncoder(config.model_dim, config.max_seq_len)
    elif config.pos_encoder == "sinusoidal":
        pos_encoder = SinusoidalPositionEncoder(config.model_dim, config.max_seq_len)
    else:
        pos_encoder = None
    frontend = MixerEncoderFrontend(
        embed, pos_encoder, _layer_norm(config) if config.embed_layer_norm else None, dropout_p=config.dropout_p
    )
    layers = [_encoder_layer(config, resolved) for _ in range(config.num_layers)]
    # Pre-norm stacks end with a layer norm; post-norm layers already end with one.
    final_norm = _layer_norm(config) if config.norm_order != TransformerNormOrder.POST else None
    encoder = StandardTransformerEncoder(layers, final_norm)
    mlm_head = MlmHead(config.model_dim, embed, layer_norm_eps=config.layer_norm_eps)
    classifier = None
    if config.num_classes > 0:
        classifier = ClassificationHead(config.model_dim, config.num_classes, pooling=config.pooling,
                                        dropout_p=config.dropout_p)
    return MixerEncoderModel(config, frontend, encoder, mlm_head, classifier)


def apply_fsdp_to_mixer_encoder(model: MixerEncoderModel, granularity: str, wrapper: FSDPWrapper) -> Module:
    """FSDP applier: wrap each encoder layer (``layer``) or the whole encoder (``stack``)."""
    if granularity == "layer":
        apply_layerwise_fsdp(model.encoder.layers, wrapper)
        return model
    if granularity == "stack":
        model.register_module("encoder", wrapper(model.encoder))
        return model
    raise NotSupportedError(f"`granularity` must be 'layer' or 'stack' for mixer_encoder, but is {granularity!r}")


def apply_ac_to_mixer_encoder(model: MixerEncoderModel, every_nth_layer: int) -> Module:
    """Layer-wise activation checkpointing applier."""
    apply_layerwise_ac(model.encoder.layers, every_nth_layer)
    return model


#: Typed access to the family: ``get_mixer_encoder_hub().create_new_model(config)``, ``.get_arch_config("tiny")``.
get_mixer_encoder_hub = ModelHubAccessor(MIXER_ENCODER_FAMILY, MixerEncoderModel, MixerEncoderConfig)
