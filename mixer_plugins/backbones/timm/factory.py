"""``create_model``: ``mixer=`` on any timm model name, and the loader for exported swapped models.

timm passes unknown keyword arguments straight to the model class, so ``timm.create_model(<timm name>,
mixer=...)`` cannot work without patching timm. This function is the non-patching equivalent::

    from mixer_plugins.backbones.timm import create_model
    model = create_model('deit_small_patch16_224', mixer='quasi')       # build, then swap_mixer
    model = create_model('eva02_tiny_patch14_224', mixer='attention', pretrained=True)
    model = create_model('local-dir:/path/exported')                    # rebuilds a swapped timm model

For our own names (``vit_base``, ``hydra_vit_base``, ...) it simply calls ``timm.create_model``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import timm
from timm.models import load_state_dict, model_entrypoint, parse_model_name, split_model_name_tag
from torch import nn

from .mixer_vit import _ENTRYPOINTS
from .swap import replay_swaps, swap_mixer
from .weights import load_compatible_state_dict

__all__ = ["create_model"]

#: The weight files timm's ``save_for_hf`` writes, in the order they are tried.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _is_ours(architecture: str) -> bool:
    fn = _ENTRYPOINTS.get(architecture)
    return fn is not None and timm.is_model(architecture) and model_entrypoint(architecture) is fn


def create_model(model_name: str, pretrained: bool = False, *, mixer: Optional[str] = None,
                 mixer_options: Optional[Mapping[str, Any]] = None, mixer_blocks: Optional[Iterable[int]] = None,
                 **kwargs: Any) -> nn.Module:
    """``timm.create_model`` that also takes ``mixer=`` for timm's own model names.

    Args:
        model_name: any timm name (with optional ``.tag``), one of ours, or ``local-dir:<folder>`` exported by
            timm's ``save_for_hf`` (swapped models are rebuilt from the ``mixer_swaps`` they recorded).
        pretrained: load the model's weights first; a swapped-in mixer then takes every old attention tensor
            whose name and shape match and the rest is reported (``model.mixer_weight_report``) and warned about.
        mixer, mixer_options, mixer_blocks: the mixer to put into the model (all blocks, or the listed ones).
        **kwargs: passed to ``timm.create_model``.
    """
    if mixer is None and (mixer_options is not None or mixer_blocks is not None):
        raise TypeError("mixer_options / mixer_blocks need mixer='<name>'")
    source, identifier = parse_model_name(model_name)
    swaps = kwargs.pop("mixer_swaps", None)
    ours = {"mixer": mixer, "mixer_options": mixer_options, "mixer_blocks": mixer_blocks, "mixer_swaps": swaps}
    ours = {k: v for k, v in ours.items() if v is not None}
    if source is None and _is_ours(split_model_name_tag(identifier)[0]):
        return timm.create_model(model_name, pretrained=pretrained, **ours, **kwargs)
    if source == "local-dir":
        # timm's export: config.json (architecture, model_args, pretrained_cfg) beside the weights
        folder = Path(identifier)
        config = json.loads((folder / "config.json").read_text())
        architecture, saved_args = config["architecture"], dict(config.get("model_args") or {})
        if _is_ours(architecture):
            return timm.create_model(model_name, pretrained=pretrained, **ours, **kwargs)
        saved_swaps = saved_args.pop("mixer_swaps", None)
        model = timm.create_model(architecture, pretrained=False, pretrained_cfg=config.get("pretrained_cfg"),
                                  pretrained_model_args=dict(saved_args), **{**saved_args, **kwargs})
        replay_swaps(model, saved_swaps)
        if pretrained:
            weights = next((folder / name for name in _WEIGHT_FILES if (folder / name).is_file()), None)
            if weights is None:
                raise FileNotFoundError(f"no weights ({' or '.join(_WEIGHT_FILES)}) in {folder}")
            report = load_compatible_state_dict(model, load_state_dict(str(weights)), source=str(weights))
            # a plain attribute: torch types a module's attributes as tensors and modules only
            model.pretrained_report = report  # type: ignore[assignment]
    else:
        model = timm.create_model(model_name, pretrained=pretrained, **kwargs)
    if mixer is not None:
        swap_mixer(model, mixer, mixer_blocks=mixer_blocks, transfer_weights=pretrained, **dict(mixer_options or {}))
    replay_swaps(model, swaps)
    return model
