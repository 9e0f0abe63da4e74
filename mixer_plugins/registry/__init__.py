"""Mixer registry: entry-point discovery, specs and configs, and the registry's errors.

Importing this package imports neither torch nor pydantic: :class:`MixerSpec` and :class:`MixerConfig` (whose module
needs both) are loaded on first access, so listing names stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # pragma: no cover
    from .spec import MixerConfig, MixerSpec

#: The process-wide registry behind :func:`mixer_plugins.create_mixer` and friends.
default_registry = MixerRegistry(ENTRY_POINT_GROUP)


def __getattr__(name: str) -> Any:
    if name in ("MixerConfig", "MixerSpec"):
        from . import spec

        return getattr(spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ENTRY_POINT_GROUP", "IN_PROCESS", "MixerRegistry", "PluginProblem", "MixerConfig", "MixerSpec", "default_registry",
    "make_register_function", "DuplicateMixerError", "InvalidMixerOptions", "MixerError", "MixerInputError",
    "MixerPluginWarning", "NotMaterializableError", "PluginLoadError", "SequenceLengthError", "UnknownMixerError",
]
