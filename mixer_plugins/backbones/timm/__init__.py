"""timm adapter: any registered mixer in timm's Vision Transformers.

After ``import mixer_plugins``, importing timm imports this package (wrapt's post-import hook; at once if timm is
already imported), which

* registers our model names in timm: ``vit_tiny``, ``vit_small``, ``vit_base``, ``vit_large`` (taking ``mixer=``,
  ``mixer_options=``, ``mixer_blocks=``) and the Hydra presets ``hydra_vit_tiny|small|base`` — never a name timm
  already has;
* makes every registered mixer name and alias a key of timm's ``ATTN_LAYERS``, so ``attn_layer='<name or alias>'``
  works on timm's own ViT-family names (``vit_*``, ``deit_*``, ``naflexvit_*``, ...), and keeps that table in step
  with mixers registered (or unregistered) later in the process.

For models already built, :func:`swap_mixer` replaces the mixer of every block (Eva and BEiT included);
:func:`create_model` is ``timm.create_model`` with ``mixer=`` for any timm name and the loader of exported
swapped models. See :mod:`.adapter` for how timm's attention arguments and masks map onto the mixer contract.
"""

from __future__ import annotations

from .adapter import (
    MASKED_LOGIT_THRESHOLD,
    MixerOnlyBlock,
    TimmMixerAttention,
    attn_layer_class,
    padding_mask_from_attn_mask,
    register_attn_layers,
    resolve_mixer_config,
)
from .factory import create_model
from .mixer_vit import HYDRA_PRESETS, MODEL_NAMES, register_timm_models
from .swap import MixerSwapWarning, is_order_sensitive, nominal_token_count, swap_mixer
from .weights import PartialWeightsWarning, WeightLoadReport, load_compatible_state_dict

__all__ = [
    "TimmMixerAttention", "MixerOnlyBlock", "swap_mixer", "create_model", "load_compatible_state_dict",
    "WeightLoadReport", "PartialWeightsWarning", "MixerSwapWarning", "padding_mask_from_attn_mask",
    "resolve_mixer_config", "attn_layer_class", "register_attn_layers", "register_timm_models", "is_order_sensitive",
    "nominal_token_count", "MODEL_NAMES", "HYDRA_PRESETS", "MASKED_LOGIT_THRESHOLD",
]

register_timm_models()
register_attn_layers()
