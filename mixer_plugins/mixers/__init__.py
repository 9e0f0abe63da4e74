"""Built-in mixers. Each module holds one mixer and its ``SPEC``, declared as an entry point.

Nothing is imported here on purpose: the registry imports a mixer's module the first time it is used.
"""

from .base import MatrixMixer, MixerContext

__all__ = ["MatrixMixer", "MixerContext"]
