"""Mixer registry: entry-point discovery, specs and configs, and the registry's errors."""

from ..errors import (
    DuplicateMixerError,
    InvalidMixerOptions,
    MixerError,
    MixerInputError,
    MixerPluginWarning,
    NotMaterializableError,
    PluginLoadError,
    SequenceLengthError,
    UnknownMixerError,
)
from .registry import ENTRY_POINT_GROUP, IN_PROCESS, MixerRegistry, PluginProblem, make_register_function
from .spec import MixerConfig, MixerSpec

#: The process-wide registry behind :func:`mixer_plugins.create_mixer` and friends.
default_registry = MixerRegistry(ENTRY_POINT_GROUP)

__all__ = [
    "ENTRY_POINT_GROUP",
    "IN_PROCESS",
    "MixerRegistry",
    "PluginProblem",
    "MixerConfig",
    "MixerSpec",
    "default_registry",
    "make_register_function",
    "DuplicateMixerError",
    "InvalidMixerOptions",
    "MixerError",
    "MixerInputError",
    "MixerPluginWarning",
    "NotMaterializableError",
    "PluginLoadError",
    "SequenceLengthError",
    "UnknownMixerError",
]
