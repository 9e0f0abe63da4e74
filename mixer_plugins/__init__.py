"""mixer-plugins: matrix mixers (structured L x L token mixers) as pluggable, tested PyTorch modules.

Quick start::

    import mixer_plugins as mp
    mp.list_mixers()                               # names, from entry points (imports no plugin code)
    mixer = mp.create_mixer("attention", dim=64, num_heads=4)
    y = mixer(x)                                   # x: (batch, length, 64)
    M = mixer.materialize(x)                       # (batch, heads, length, length)

Importing the package is cheap (it imports neither torch nor timm): the public names below are loaded on first use.
It registers a post-import hook for timm (``wrapt.register_post_import_hook``): when timm is imported, or at once if
it already is, the timm adapter (:mod:`mixer_plugins.backbones.timm`) is imported, which registers our model names
and ``attn_layer`` keys with timm, after which ``timm.create_model('vit_base', mixer='quasi')`` works.
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

import wrapt

__version__ = "0.1.0"

# module -> the public names it defines (each imported on first access)
_LAZY: dict[str, str] = {name: module for module, names in {
    "mixer_plugins.mixers.base": ("MatrixMixer", "MixerContext", "strip_mixer_records"),
    "mixer_plugins.mixers.cache": ("MixerCache",),
    "mixer_plugins.registry": ("ENTRY_POINT_GROUP", "MixerConfig", "MixerSpec", "MixerRegistry", "PluginProblem",
                               "default_registry"),
    "mixer_plugins.errors": ("MixerError", "UnknownMixerError", "InvalidMixerOptions", "DuplicateMixerError",
                             "PluginLoadError", "MixerInputError", "SequenceLengthError", "NotMaterializableError",
                             "MixerPluginWarning", "BackendUnavailableError", "MissingExtraError",
                             "MixerCheckpointMismatchError", "StepNotSupportedError"),
    "mixer_plugins.backbones.timm": ("swap_mixer",),
}.items() for name in names}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .backbones.timm import swap_mixer
    from .errors import (
        BackendUnavailableError,
        DuplicateMixerError,
        InvalidMixerOptions,
        MissingExtraError,
        MixerCheckpointMismatchError,
        MixerError,
        MixerInputError,
        MixerPluginWarning,
        NotMaterializableError,
        PluginLoadError,
        SequenceLengthError,
        StepNotSupportedError,
        UnknownMixerError,
    )
    from .mixers.base import MatrixMixer, MixerContext, strip_mixer_records
    from .mixers.cache import MixerCache
    from .registry import (
        ENTRY_POINT_GROUP,
        MixerConfig,
        MixerRegistry,
        MixerSpec,
        PluginProblem,
        default_registry,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mixer_plugins' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _registry() -> MixerRegistry:
    from .registry import default_registry

    return default_registry


def list_mixers() -> list[str]:
    """Names of every registered mixer (built-in and plugins), sorted. Imports no plugin code."""
    return _registry().names()


def list_specs() -> list[MixerSpec]:
    """Specs of every loadable mixer. Imports all plugins; broken ones are warned about and skipped."""
    return _registry().specs()


def plugin_problems() -> list[PluginProblem]:
    """Broken plugins, names claimed twice and conflicting aliases."""
    return _registry().problems()


def get_spec(name: str) -> MixerSpec:
    """The :class:`MixerSpec` of a mixer, by name or alias. A built-in's name or alias imports no plugin, and a
    plugin mixer's name imports that plugin alone."""
    return _registry().get_spec(name)


def create_mixer(name: str, dim: int | None = None, /, **options: Any) -> MatrixMixer[Any]:
    """Build a mixer by name or alias; ``options`` are validated by the mixer's config model.

    Raises :class:`UnknownMixerError` (with "did you mean") for an unknown name and
    :class:`InvalidMixerOptions` for bad or misspelt options.
    """
    if dim is None and "dim" in options:
        dim = options.pop("dim")
    return _registry().create(name, dim, **options)


def register_mixer(*args: Any, **kwargs: Any) -> Any:
    """Register a mixer in this process only (notebooks, tests).

    Takes a :class:`MixerSpec`, or is used as ``@register_mixer("name", config=MyConfig, summary=...)`` on a mixer
    class. Entry points (group ``mixer_plugins.mixers``) are the way to ship one.
    """
    from .registry import make_register_function

    return make_register_function(_registry())(*args, **kwargs)


def unregister_mixer(name: str) -> None:
    """Remove a mixer registered with :func:`register_mixer`."""
    _registry().unregister(name)


__all__ = [
    "__version__", "list_mixers", "list_specs", "plugin_problems", "get_spec", "create_mixer", "register_mixer",
    "unregister_mixer", "ENTRY_POINT_GROUP", "MatrixMixer", "MixerContext", "MixerConfig", "MixerSpec",
    "MixerRegistry", "PluginProblem", "default_registry", "MixerError", "UnknownMixerError", "InvalidMixerOptions",
    "DuplicateMixerError", "PluginLoadError", "MixerInputError", "SequenceLengthError", "NotMaterializableError",
    "MixerPluginWarning", "BackendUnavailableError", "MissingExtraError", "MixerCheckpointMismatchError",
    "StepNotSupportedError", "MixerCache", "strip_mixer_records", "swap_mixer",
]


def _register_with_timm(timm: ModuleType) -> None:
    """Called by wrapt once timm is imported: import our timm adapter, which registers our names with timm. A
    failure is a warning, never an error of the user's ``import timm``."""
    try:
        importlib.import_module("mixer_plugins.backbones.timm")
    except Exception as err:  # noqa: BLE001 - never break the user's `import timm`
        warnings.warn(f"mixer-plugins could not register its timm models: {type(err).__name__}: {err}",
                      RuntimeWarning, stacklevel=2)


wrapt.register_post_import_hook(_register_with_timm, "timm")
