"""The ``mixer_encoder`` family: a BERT-like encoder-only model (embeddings, a ``StandardTransformerEncoder`` whose
self-attention is any registered mixer, an MLM head and a sequence-classification head), its config and presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import torch
from fairseq2.error import NotSupportedError
from fairseq2.models import ModelHubAccessor
from fairseq2.models.transformer import (
    AttentionBiasCache,
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
    Linear,
    PositionEncoder,
    StandardEmbedding,
    StandardLayerNorm,
    TiedProjection,
)
from fairseq2.nn.fsdp import FSDPWrapper
from fairseq2.nn.functional import cross_entropy
from torch import Tensor
from torch.nn import GELU, Dropout, Module, Parameter

from .attention import MixerAttention, unpack_layout
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

__all__ = ["BERT_VOCAB_SIZE", "ENCODER_FAMILY", "MIXER_ENCODER_FAMILY", "MixerEncoderConfig", "MixerEncoderModel",
           "create_mixer_encoder_model", "get_mixer_encoder_hub"]

MIXER_ENCODER_FAMILY: Final = "mixer_encoder"

#: BERT's WordPiece vocabulary padded to a multiple of 8, as in the Hydra and MosaicBERT runs.
BERT_VOCAB_SIZE: Final = 30_528


@dataclass(kw_only=True)
class MixerEncoderConfig(MixerModelConfig):
    """An encoder-only Transformer (BERT-like) whose token mixer is any registered mixer; with ``ffn_inner_dim=0``
    the feed-forward block is dropped (the Hydra BERT layer is mixer-only)."""

    positive = ("model_dim", "num_layers", "vocab_size", "max_seq_len")

    vocab_size: int = BERT_VOCAB_SIZE
    """Size of the token vocabulary (the MLM head is tied to the embedding table)."""

    max_seq_len: int = 512
    """Longest sequence: sizes the position table, and is given to mixers that have a ``max_seq_len`` option
    (data-independent mixers) unless set under ``mixer_options``."""

    embed_layer_norm: bool = False
    """Layer norm on the embeddings (BERT-style, for post-norm stacks)."""

    num_classes: int = 0
    """Classes of the sequence-classification head (``model.classify``); 0: no such head."""

    pooling: Literal["cls", "mean"] = "mean"
    """How ``classify`` pools a sequence: its first token (``cls``) or the mean over its real tokens."""

    def structural_problems(self) -> list[str]:
        problems = super().structural_problems()
        if self.ffn_inner_dim < 0:
            problems.append(
                f"`ffn_inner_dim` must be >= 0 (0 drops the feed-forward block), but is {self.ffn_inner_dim}."
            )
        if self.num_classes < 0:
            problems.append(f"`num_classes` must be >= 0 (0: no classification head), but is {self.num_classes}.")
        return problems


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



def _encoder_layer(config: MixerEncoderConfig, self_attn: MixerAttention) -> TransformerEncoderLayer:
    if config.ffn_inner_dim == 0:
        return MixerOnlyEncoderLayer(self_attn, build_layer_norm(config), norm_order=config.norm_order,
                                     dropout_p=config.dropout_p)
    return StandardTransformerEncoderLayer(self_attn, build_layer_norm(config), build_ffn(config),
                                           build_layer_norm(config), norm_order=config.norm_order,
                                           dropout_p=config.dropout_p)


def create_mixer_encoder_model(config: MixerEncoderConfig) -> MixerEncoderModel:
    """The family factory; validates first (:func:`~.family.checked_mixer`)."""
    resolved = checked_mixer(config, MixerEncoderConfig, MIXER_ENCODER_FAMILY)
    embed, pos_encoder = build_embedding(config)
    frontend = MixerEncoderFrontend(embed, pos_encoder, build_layer_norm(config) if config.embed_layer_norm else None,
                                    dropout_p=config.dropout_p)
    layers = [_encoder_layer(config, MixerAttention(resolved)) for _ in range(config.num_layers)]
    encoder = StandardTransformerEncoder(layers, build_final_norm(config))
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

#: The family our extension entry point registers. Generic presets keep ``mixer="attention"`` and no mixer options,
#: so ``--config model.config_overrides.mixer=NAME`` gives that mixer with its own defaults; paper presets pin one.
ENCODER_FAMILY = MixerFamily(
    MIXER_ENCODER_FAMILY, MixerEncoderModel, MixerEncoderConfig, create_mixer_encoder_model,
    archs={
        "tiny": TINY_ARCH,
        "small": SMALL_ARCH,
        # BERT-base shape: 12 post-norm layers, 768 wide, 12 heads, GELU FFN 3072, embedding layer norm.
        "base": dict(model_dim=768, num_layers=12, num_heads=12, ffn_inner_dim=3072, vocab_size=BERT_VOCAB_SIZE,
                     max_seq_len=512, pos_encoder="learned", embed_layer_norm=True,
                     norm_order=TransformerNormOrder.POST, layer_norm_eps=1e-12, dropout_p=0.1),
        # Hydra BERT (Hwang et al. 2024, Table 4): 23 post-norm layers of the quasiseparable mixer alone (no FFN: the
        # gated, expanded mixer block is the channel mixer too), width 768, no position embeddings, embedding layer
        # norm. The mixer keeps its own (paper) defaults: num_heads=None.
        "base_hydra": dict(model_dim=768, num_layers=23, num_heads=None, ffn_inner_dim=0, vocab_size=BERT_VOCAB_SIZE,
                           max_seq_len=512, pos_encoder="none", embed_layer_norm=True,
                           norm_order=TransformerNormOrder.POST, layer_norm_eps=1e-5, dropout_p=0.1,
                           mixer="quasiseparable"),
    },
    fsdp_applier=apply_fsdp_to_mixer_encoder, layerwise_ac_applier=apply_ac_to_mixer_encoder,
)

#: Typed access to the family: ``get_mixer_encoder_hub().create_new_model(config)``, ``.get_arch_config("tiny")``.
get_mixer_encoder_hub = ModelHubAccessor(MIXER_ENCODER_FAMILY, MixerEncoderModel, MixerEncoderConfig)
