"""The error tree of mixer-plugins: a leaf module that every layer may import (it imports nothing of ours).

Every error the library raises on bad input derives from :class:`MixerError` (itself a
``ValueError``), so callers can catch one type; the subclasses say what went wrong.
"""

from __future__ import annotations

__all__ = [
    "StepNotSupportedError",
    "MixerCheckpointMismatchError",
    "MixerError",
    "UnknownMixerError",
    "InvalidMixerOptions",
    "DuplicateMixerError",
    "PluginLoadError",
    "MixerInputError",
    "SequenceLengthError",
    "NotMaterializableError",
    "MixerPluginWarning",
    "BackendUnavailableError",
    "MissingExtraError",
]


class MixerError(ValueError):
    """Base class of every error raised by mixer-plugins on bad input or configuration."""


class UnknownMixerError(MixerError):
    """No registered mixer has the requested name or alias."""

    def __init__(self, name: str, suggestions: list[str] | None = None, known: list[str] | None = None):
        self.name = name
        self.suggestions = list(suggestions or [])
        self.known = list(known or [])
        msg = f"unknown mixer {name!r}"
        if self.suggestions:
            msg += f"; did you mean {' or '.join(repr(s) for s in self.suggestions)}?"
        if self.known:
            msg += f" (registered mixers: {', '.join(self.known)})"
        super().__init__(msg)


class InvalidMixerOptions(MixerError):
    """The options given for a mixer failed validation by the mixer's config model."""

    def __init__(self, mixer: str, problems: list[str]):
        self.mixer = mixer
        self.problems = list(problems)
        if len(problems) == 1:
            msg = f"invalid options for mixer {mixer!r}: {problems[0]}"
        else:
            msg = f"invalid options for mixer {mixer!r}:\n" + "\n".join(f"  - {p}" for p in problems)
        super().__init__(msg)


class DuplicateMixerError(MixerError):
    """Two distributions (or registrations) claim the same mixer name or alias."""

    def __init__(self, name: str, claimants: list[str]):
        self.name = name
        self.claimants = list(claimants)
        super().__init__(
            f"mixer name {name!r} is claimed more than once, by {' and '.join(claimants)}; "
            "uninstall one of them or rename its entry point"
        )


class PluginLoadError(MixerError):
    """A mixer plugin's entry point could not be imported or did not yield a valid spec."""

    def __init__(self, name: str, distribution: str, target: str, cause: BaseException | str):
        self.name = name
        self.distribution = distribution
        self.target = target
        self.cause = cause
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(
            f"mixer plugin {name!r} from distribution {distribution!r} ({target}) could not be loaded: {reason}"
        )


class MixerInputError(MixerError):
    """A mixer was called with an input of the wrong rank, width, dtype or device, or a bad mask."""


class SequenceLengthError(MixerInputError):
    """A data-independent mixer was called at a length its parameters do not cover."""


class NotMaterializableError(MixerError, NotImplementedError):
    """The mixer is not linear in its values, so it has no L x L matrix (e.g. the ``mult`` ablation)."""


class MixerPluginWarning(UserWarning):
    """Emitted when a plugin is broken or a name is claimed twice; the other mixers keep working."""


class BackendUnavailableError(MixerError):
    """The requested kernel backend cannot run this op on these tensors (missing package, wrong device, ...)."""


class MixerCheckpointMismatchError(MixerError):
    """``load_state_dict`` was given the checkpoint of another mixer, or of the same mixer with other options
    (strip the records with :func:`mixer_plugins.strip_mixer_records` to load it anyway)."""


class StepNotSupportedError(MixerError, NotImplementedError):
    """The mixer cannot decode token by token: it is bidirectional, or its kind has no step (its spec says
    ``stepping=False``)."""


class MissingExtraError(MixerError):
    """An optional dependency is not installed; the message names the extra and the install command."""
