"""Our timm model names: ``vit_tiny|small|base|large`` (any mixer) and the ``hydra_vit_tiny|small|base`` presets.

After ``import mixer_plugins``::

    timm.create_model('vit_base', mixer='quasi')                        # ViT-B/16, 224 px, quasiseparable mixer
    timm.create_model('vit_small', mixer='attention', pretrained=True)  # == vit_small_patch16_224.augreg_in21k_ft_in1k
    timm.create_model('hydra_vit_base')                                 # Hydra's ImageNet ViT-B (see below)

Every name takes timm's ``VisionTransformer`` arguments plus ``mixer`` (a registered mixer name or alias; default
``attention``), ``mixer_options`` (a dict of that mixer's options), ``mixer_blocks`` (indices of the blocks that
get the mixer; the others keep timm's attention) and ``mixer_swaps`` (later swaps, as recorded by
:func:`~mixer_plugins.backbones.timm.swap_mixer`). They are recorded in ``model._model_args``, so timm's
``save_for_hf`` / ``create_model('local-dir:...')`` round trip rebuilds the same model.

``pretrained=True`` loads the matching timm ViT checkpoint (AugReg ImageNet-21k -> 1k; or any file through
``pretrained_cfg_overlay=dict(file=...)``): every tensor whose name and shape match is loaded, the rest is
reported (``model.pretrained_report``) and warned about.

A name timm already defines is never overwritten: :func:`register_timm_models` skips it with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Optional, cast

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchDropout
from timm.models import (
    PretrainedCfg,
    build_model_with_cfg,
    generate_default_cfgs,
    get_pretrained_cfg,
    is_model,
    register_model,
)
from timm.models import vision_transformer as _vit
from torch import nn

from ...registry import MixerError, default_registry
from .adapter import MixerOnlyBlock, TimmMixerAttention
from .swap import block_indices, replay_swaps, warn_causal_token_pool
from .weights import PartialWeightsWarning, pretrained_filter, report_from_box

__all__ = ["register_timm_models", "MODEL_NAMES", "HYDRA_PRESETS"]

# ViT-B/16-style architectures (patch 16, 224 px, MLP ratio 4), as timm's vit_*_patch16_224.
_VIT_ARCHS: dict[str, dict[str, Any]] = {
    "vit_tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
    "vit_large": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16),
}
# timm's attention weights each name loads with pretrained=True (same tensor names and shapes).
_PRETRAINED_SOURCES: dict[str, str] = {
    "vit_tiny": "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
    "vit_small": "vit_small_patch16_224.augreg_in21k_ft_in1k",
    "vit_base": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_large": "vit_large_patch16_224.augreg_in21k_ft_in1k",
}
# Hydra's ImageNet-1k ViT (Hwang et al. 2024, App. D.2 / Table 9): the ViT's width, twice its depth of mixer-only
# blocks (no MLP), patch 16 at 224 px in row-major order, no position embedding, stochastic depth 0.5. The paper does
# not say how it pools; like the S4-ViT config of the codebase the authors point to, we use no class token and
# average pooling. The mixer keeps its own defaults (Hydra: d_state 64, expand 2, head dim 64), not ViT's heads.
HYDRA_PRESETS: dict[str, dict[str, Any]] = {
    f"hydra_{name}": dict(
        _VIT_ARCHS[name], depth=2 * _VIT_ARCHS[name]["depth"], pos_embed="none", class_token=False,
        global_pool="avg", drop_path_rate=0.5,
    )
    for name in ("vit_tiny", "vit_small", "vit_base")
}
MODEL_NAMES: tuple[str, ...] = tuple(_VIT_ARCHS) + tuple(HYDRA_PRESETS)


def _plain_cfg(**overrides: Any) -> dict[str, Any]:
    return dict(
        url="", num_classes=1000, input_size=(3, 224, 224), pool_size=None, crop_pct=0.9, interpolation="bicubic",
        fixed_input_size=True, mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
        first_conv="patch_embed.proj", classifier="head", **overrides,
    )


def _vit_cfgs() -> dict[str, dict[str, Any] | PretrainedCfg]:
    cfgs: dict[str, dict[str, Any] | PretrainedCfg] = {}
    for name, source in _PRETRAINED_SOURCES.items():
        try:
            pretrained = get_pretrained_cfg(source)
        except Exception:  # noqa: BLE001 - a future timm without this checkpoint: no weights, same defaults
            pretrained = None
        if pretrained is None:
            cfgs[name] = _plain_cfg()
            continue
        cfg = dataclasses.asdict(pretrained)
        for key in ("architecture", "tag", "custom_load", "state_dict", "file", "source"):
            cfg.pop(key, None)
        cfgs[f"{name}.{source.split('.', 1)[1]}"] = cfg  # e.g. vit_base.augreg2_in21k_ft_in1k, like timm's tags
    for name in HYDRA_PRESETS:
        cfgs[name] = _plain_cfg()  # no released weights
    return cfgs


# timm's register_model reads `default_cfgs` from the entrypoint's module.
default_cfgs = generate_default_cfgs(_vit_cfgs())


# -- building ---------------------------------------------------------------------------------------------------

class _PendingMixer(nn.Module):
    """Stands in for a block's mixer until the model (and so its token count) exists; records timm's arguments."""

    def __init__(self, dim: int, **host: Any) -> None:
        super().__init__()
        host.pop("norm_layer", None)
        host.pop("depth", None)
        self.host = dict(host, dim=dim)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # pragma: no cover - replaced
        raise RuntimeError("mixer placeholder was not replaced; this is a bug in mixer_plugins")


def _build_vision_transformer(mixer: str, options: Mapping[str, Any], blocks: set[int],
                              swaps: Optional[Sequence[Mapping[str, Any]]], mlp: bool, inherit_num_heads: bool,
                              fix_init: bool, **kwargs: Any) -> _vit.VisionTransformer:
    """``VisionTransformer(**kwargs)`` with ``mixer`` in ``blocks``, then ``swaps``; what ``build_model_with_cfg``
    calls, so pretrained weights load into the finished model."""

    def block_fn(*, depth: int, attn_layer: Any = None, **block_kwargs: Any) -> nn.Module:
        attn = _PendingMixer if depth in blocks else (attn_layer or _vit.Attention)
        return (_vit.Block if mlp else MixerOnlyBlock)(depth=depth, attn_layer=attn, **block_kwargs)

    # timm annotates block_fn as a class; it only calls it
    model = _vit.VisionTransformer(block_fn=block_fn, fix_init=False, **kwargs)  # type: ignore[arg-type]
    seq_len = int(model.patch_embed.num_patches) + model.num_prefix_tokens
    for block in model.blocks:
        if isinstance(block.attn, _PendingMixer):
            host = dict(block.attn.host)
            block.attn = TimmMixerAttention(host.pop("dim"), mixer=mixer, mixer_options=options, seq_len=seq_len,
                                            num_prefix_tokens=model.num_prefix_tokens,
                                            inherit_num_heads=inherit_num_heads, **host)
    if isinstance(model.patch_drop, PatchDropout):
        # Kept patches stay in raster order: order-sensitive mixers need it, attention does not care.
        model.patch_drop.ordered = True
    first = next((b.attn for b in model.blocks if isinstance(b.attn, TimmMixerAttention)), None)
    if first is not None:
        warn_causal_token_pool(model, first)
    replay_swaps(model, swaps)
    if fix_init:
        model.fix_init = True   # later model.init_weights() calls re-apply it
        model.fix_init_weight()
    return model


def _create_mixer_vit(variant: str, pretrained: bool = False, *, mlp: bool = True, inherit_num_heads: bool = True,
                      default_mixer: str = "attention", **kwargs: Any) -> nn.Module:
    mixer = kwargs.pop("mixer", default_mixer)
    if not isinstance(mixer, str):
        raise TypeError(f"{variant}: mixer must be a registered mixer name (str), got {type(mixer).__name__}")
    mixer_options = kwargs.pop("mixer_options", None) or {}
    if not isinstance(mixer_options, Mapping):
        raise TypeError(f"{variant}: mixer_options must be a dict of the mixer's options, got {mixer_options!r}")
    mixer_blocks = kwargs.pop("mixer_blocks", None)
    mixer_swaps = kwargs.pop("mixer_swaps", None)
    for taken in ("block_fn", "attn_layer"):
        if taken in kwargs:
            raise TypeError(f"{variant} builds its blocks from mixer=...; {taken}= is not accepted "
                            f"(use timm's own ViT names for a custom {taken})")
    fix_init = bool(kwargs.pop("fix_init", False))
    if fix_init and not mlp:
        raise MixerError(f"{variant} has no MLP in its blocks; fix_init=True rescales mlp.fc2 and cannot apply")
    spec = default_registry.get_spec(mixer)  # unknown names fail here, with "did you mean"
    blocks = set(block_indices(mixer_blocks, int(kwargs["depth"])))
    out_indices = kwargs.pop("out_indices", 3)
    strict = kwargs.pop("pretrained_strict", False)
    box: dict[str, Any] = {}
    model = build_model_with_cfg(
        functools.partial(_build_vision_transformer, spec.name, dict(mixer_options), blocks, mixer_swaps, mlp,
                          inherit_num_heads, fix_init),
        variant,
        pretrained,
        pretrained_filter_fn=pretrained_filter(_vit.checkpoint_filter_fn, box),
        pretrained_strict=strict,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )
    if pretrained:
        # a dict timm sets on every model it builds (nn.Module's attributes are typed as tensors and modules)
        cfg = cast(dict[str, Any], model.pretrained_cfg)
        if cfg.get("custom_load"):
            raise MixerError(f"{variant}: checkpoints with timm's custom loader (.npz) expect attention tensors; "
                             "convert them to a PyTorch state dict first")
        classifier = cfg.get("classifier") or "head"
        reset = [f"{classifier}.weight", f"{classifier}.bias"] if kwargs.get("num_classes", cfg.get(
            "num_classes")) != cfg.get("num_classes") else []
        source = cfg.get("file") or cfg.get("hf_hub_id") or cfg.get("url") or "the pretrained checkpoint"
        report = report_from_box(box, str(source), reset)
        if report is None:
            warnings.warn(f"{variant}: timm loaded the weights without a state dict; cannot report what was "
                          "loaded", PartialWeightsWarning, stacklevel=3)
        else:
            # a plain attribute: torch types a module's attributes as tensors and modules only
            model.pretrained_report = report  # type: ignore[assignment]
            report.warn_if_partial(stacklevel=4)
    return model


# -- entrypoints ------------------------------------------------------------------------------------------------

def _entrypoint(variant: str) -> Any:
    """timm's model function for ``variant``, named so (timm registers it under its ``__name__``)."""
    hydra = variant in HYDRA_PRESETS
    arch = HYDRA_PRESETS[variant] if hydra else _VIT_ARCHS[variant]
    size = {"tiny": "Ti", "small": "S", "base": "B", "large": "L"}[variant.rsplit("_", 1)[1]]

    def create(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        if hydra:
            return _create_mixer_vit(variant, pretrained, mlp=False, inherit_num_heads=False, default_mixer="quasi",
                                     **dict(arch, **kwargs))
        return _create_mixer_vit(variant, pretrained, **dict(arch, **kwargs))

    create.__name__ = create.__qualname__ = variant
    create.__doc__ = (
        f"Hydra-ViT-{size} (Hwang et al. 2024, ImageNet): {arch['depth']} mixer-only ``quasi`` blocks of width "
        f"{arch['embed_dim']}, no position embedding, average pooling, stochastic depth 0.5." if hydra else
        f"ViT-{size}/16 (width {arch['embed_dim']}, {arch['depth']} blocks, {arch['num_heads']} heads) at 224 px "
        "with ``mixer`` (default ``attention``)."
    )
    return create


_ENTRYPOINTS = {name: _entrypoint(name) for name in MODEL_NAMES}
globals().update(_ENTRYPOINTS)  # mixer_vit.vit_base(...) and friends, also where timm has a model of that name


def _register_entrypoint(fn: Any) -> bool:
    """Register ``fn`` under its name unless timm already has that name (then warn and skip)."""
    from timm.models import model_entrypoint

    name = fn.__name__
    if is_model(name):
        if model_entrypoint(name) is fn:
            return True  # already ours
        warnings.warn(
            f"timm already defines a model named {name!r}; mixer-plugins does not overwrite it, so "
            f"timm.create_model({name!r}) builds timm's model. Ours stays available as "
            f"mixer_plugins.backbones.timm.mixer_vit.{name}(mixer=...)", UserWarning, stacklevel=3,
        )
        return False
    register_model(fn)
    return True


def register_timm_models() -> list[str]:
    """Register our names in timm's model registry (skipping any name timm already has); returns those added."""
    return [name for name, fn in _ENTRYPOINTS.items() if _register_entrypoint(fn)]
