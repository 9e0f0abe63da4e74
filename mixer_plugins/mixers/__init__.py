"""Built-in mixers. Each module holds one mixer and its ``SPEC``, declared as an entry point.

Only the base contract is imported here: the registry imports a mixer's module the first time it is used.
"""

from .base import MatrixMixer, MixerContext, QKContext

__all__ = ["MatrixMixer", "MixerContext", "QKContext"]
