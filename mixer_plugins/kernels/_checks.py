"""Argument checks shared by the ops: a failed check is a :class:`~mixer_plugins.errors.MixerInputError`."""

from __future__ import annotations

from ..errors import MixerInputError

__all__ = ["check"]


def check(cond: bool, message: str) -> None:
    """Raise :class:`MixerInputError` with ``message`` unless ``cond``."""
    if not cond:
        raise MixerInputError(message)
