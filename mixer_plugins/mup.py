"""Moved to :mod:`mixer_plugins.layers.mup` (the name-based ``CoordCheckModel`` to :mod:`mixer_plugins.testing`)."""
# TRANSITIONAL re-export (lead removes at merge)
from .layers.mup import *  # noqa: F401,F403
from .layers.mup import __all__  # noqa: F401
from .testing.coord_check import MixerCoordCheckModel as CoordCheckModel  # noqa: F401
