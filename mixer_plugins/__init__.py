"""mixer-plugins: matrix mixers (structured L x L token mixers) as pluggable, tested PyTorch modules.

Quick start::

    import mixer_plugins as mp
    mp.list_mixers()                               # names, from entry points (imports no plugin code)
    mixer = mp.create_mixer("attention", dim=64, num_heads=4)
    y = mixer(x)                                   # x: (batch, length, 64)
    M = mixer.materialize(x)                       # (batch, heads, length, length)
"""

from __future__ import annotations

from typing import Any

# Importing the timm adapter registers our timm model names (vit_base, hydra_vit_base, ...) and
# attn_layer='<mixer name>' in timm.
from .backbones.timm import swap_mixer
from .mixers.base import MatrixMixer, MixerContext
from .registry import (
    ENTRY_POINT_GROUP,
    DuplicateMixerError,
    InvalidMixerOptions,
    MixerConfig,
    MixerError,
    MixerInputError,
    MixerPluginWarning,
    MixerRegistry,
    MixerSpec,
    NotMaterializableError,
    PluginLoadError,
    PluginProblem,
    SequenceLengthError,
    UnknownMixerError,
    default_registry,
    make_register_function,
)

__version__ = "0.1.0"


def list_mixers() -> list[str]:
    """Names of every registered mixer (built-in and plugins), sorted. Imports no plugin code."""
    return default_registry.names()


def list_specs() -> list[MixerSpec]:
    """Specs of every loadable mixer. Imports all plugins; broken ones are warned about and skipped."""
    return default_registry.specs()


def plugin_problems() -> list[PluginProblem]:
    """Broken plugins, names claimed twice and conflicting aliases."""
    return default_registry.problems()


def get_spec(name: str) -> MixerSpec:
    """The :class:`MixerSpec` of a mixer, by name or alias."""
    return default_registry.get_spec(name)


def create_mixer(name: str, dim: int | None = None, /, **options: Any) -> MatrixMixer:
    """Build a mixer by name or alias; ``options`` are validated by the mixer's config model.

    Raises :class:`UnknownMixerError` (with "did you mean") for an unknown name and
    :class:`InvalidMixerOptions` for bad or misspelt options.
    """
    if dim is None and "dim" in options:
        dim = options.pop("dim")
    return default_registry.create(name, dim, **options)


#: Register a mixer in this process only (notebooks, tests). Takes a :class:`MixerSpec`, or is used as
#: ``@register_mixer("name", config=MyConfig, summary=...)`` on a mixer class.
register_mixer = make_register_function(default_registry)


def unregister_mixer(name: str) -> None:
    """Remove a mixer registered with :func:`register_mixer`."""
    default_registry.unregister(name)


__all__ = [
    "__version__",
    "ENTRY_POINT_GROUP",
    "MatrixMixer",
    "MixerContext",
    "MixerConfig",
    "MixerSpec",
    "MixerRegistry",
    "PluginProblem",
    "list_mixers",
    "list_specs",
    "plugin_problems",
    "get_spec",
    "create_mixer",
    "register_mixer",
    "unregister_mixer",
    "default_registry",
    "MixerError",
    "UnknownMixerError",
    "InvalidMixerOptions",
    "DuplicateMixerError",
    "PluginLoadError",
    "MixerInputError",
    "SequenceLengthError",
    "NotMaterializableError",
    "MixerPluginWarning",
    "swap_mixer",
]
