"""The muP coordinate-check model with its mixers picked by registry name.

:class:`mixer_plugins.layers.mup.CoordCheckModel` takes a mixer factory (the layers never import the registry); this
subclass builds each block's mixer with :func:`mixer_plugins.create_mixer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..layers.mup import CoordCheckModel
from ..registry import default_registry

__all__ = ["MixerCoordCheckModel"]


class MixerCoordCheckModel(CoordCheckModel):
    """:class:`~mixer_plugins.layers.mup.CoordCheckModel` whose blocks hold the registered mixer ``mixer``.

    ``mixer_options`` go to :func:`mixer_plugins.create_mixer` (validated by the mixer's config).
    """

    def __init__(self, width: int, mixer: str = "attention", *, depth: int = 2, in_dim: int = 8, out_dim: int = 1,
                 mlp_ratio: int = 4, mixer_options: Mapping[str, Any] | None = None):
        spec = default_registry.get_spec(mixer)  # an unknown name fails here, once, with "did you mean"
        options = dict(mixer_options or {})
        super().__init__(width, lambda w: default_registry.create(spec.name, w, **options), depth=depth,
                         in_dim=in_dim, out_dim=out_dim, mlp_ratio=mlp_ratio)
