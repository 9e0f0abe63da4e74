"""Moved to :mod:`mixer_plugins.layers.mlbtc`."""
# TRANSITIONAL re-export (lead removes at merge)
from .layers.mlbtc import *  # noqa: F401,F403
from .layers.mlbtc import __all__  # noqa: F401
