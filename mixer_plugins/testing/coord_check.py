"""The muP coordinate-check model with its mixers picked by registry name.

:class:`mixer_plugins.layers.mup.CoordCheckModel` takes a mixer factory (the layers never import the registry); this
subclass builds each block's mixer with :func:`mixer_plugins.create_mixer`, and gives plain attention the logits probe
(:func:`expose_attention_logits`) so that the coordinate check records every softmax mixer's attention logits.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..layers.mup import CoordCheckModel
from ..mixers.attention import SoftmaxAttention
from ..registry import default_registry

__all__ = ["MixerCoordCheckModel", "expose_attention_logits"]


class MixerCoordCheckModel(CoordCheckModel):
    """:class:`~mixer_plugins.layers.mup.CoordCheckModel` whose blocks hold the registered mixer ``mixer``.

    ``mixer_options`` go to :func:`mixer_plugins.create_mixer` (validated by the mixer's config).
    """

    def __init__(self, width: int, mixer: str = "attention", *, depth: int = 2, in_dim: int = 8, out_dim: int = 1,
                 mlp_ratio: int = 4, mixer_options: Mapping[str, Any] | None = None):
        spec = default_registry.get_spec(mixer)  # an unknown name fails here, once, with "did you mean"
        options = dict(mixer_options or {})
        def build(w: int) -> nn.Module:
            return expose_attention_logits(default_registry.create(spec.name, w, **options))

        super().__init__(width, build, depth=depth, in_dim=in_dim, out_dim=out_dim, mlp_ratio=mlp_ratio)


def _plain_attention_logits(mixer: SoftmaxAttention, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """Plain softmax attention's pre-softmax logits ``scale * q_i . k_j``, (batch, heads, L, L)."""
    x, mask, _ = mixer._begin(x, mask)
    ctx = mixer.prepare(x, mask)
    return torch.einsum("bihd,bjhd->bhij", ctx.q, ctx.k) * mixer.scale


def expose_attention_logits(mixer: nn.Module) -> nn.Module:
    """Give plain ``attention`` the :class:`~mixer_plugins.layers.mup.AttentionLogitsProbe` method (the structured
    softmax mixers have it already), so :func:`~mixer_plugins.layers.mup.coord_check` records its logits."""
    if isinstance(mixer, SoftmaxAttention) and not hasattr(mixer, "attention_logits"):
        # a plain attribute: torch types a module's attributes as tensors and modules only
        mixer.attention_logits = types.MethodType(_plain_attention_logits, mixer)  # type: ignore[assignment]
    return mixer
