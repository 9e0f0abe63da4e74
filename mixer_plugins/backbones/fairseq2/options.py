"""From the two config fields a fairseq2 user edits (``mixer``, ``mixer_options``) to a validated mixer config.

``mixer_options`` is namespaced by mixer name (``{"quasi": {"d_state": 32}, "attention": {...}}``): only the chosen
mixer's entry is used, so fairseq2's merging of nested overrides never leaks one mixer's options into another. Names
and options are checked by the registry (our "did you mean" errors) before fairseq2 builds anything. The host model
fills in what the mixer cannot know (``dim``; ``num_heads``, ``max_seq_len`` and ``causal`` where the mixer has such an
option and the user did not set it) through the shared resolver (:mod:`mixer_plugins.backbones.options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mixer_plugins.registry import InvalidMixerOptions, MixerConfig, MixerError, MixerSpec, default_registry
from mixer_plugins.registry.registry import normalize_name

from ..options import HostModel, resolve_config

__all__ = ["ResolvedMixer", "resolve_mixer", "mixer_problems", "namespaced_options"]


@dataclasses.dataclass(frozen=True)
class ResolvedMixer:
    """The outcome of :func:`resolve_mixer`: which mixer, with which validated options.

    Attributes:
        spec: the registry entry of the chosen mixer (``spec.name`` is canonical even if an alias was used).
        config: the validated mixer config (``config.dim`` is the host model's width).
        from_host: options filled in from the host model config (not set by the user), by name.
    """

    spec: MixerSpec
    config: MixerConfig
    from_host: Mapping[str, Any]


def namespaced_options(spec: MixerSpec, mixer_options: Mapping[str, object]) -> dict[str, object]:
    """The options stored under ``spec``'s namespace of ``mixer_options`` (a copy; ``{}`` when none).

    Every namespace key must name a registered mixer and hold a mapping; two keys naming the same mixer
    (e.g. a name and its alias) are an error.
    """
    if not isinstance(mixer_options, Mapping):
        raise InvalidMixerOptions(
            spec.name,
            [f"mixer_options must be a mapping from mixer name to options, e.g. "
             f"{{{spec.name!r}: {{...}}}}, got {type(mixer_options).__name__} {mixer_options!r}"],
        )
    matching: list[str] = []
    chosen: Mapping[Any, object] = {}
    for key, value in mixer_options.items():
        if not isinstance(key, str):
            raise InvalidMixerOptions(spec.name, [f"mixer_options keys must be mixer names, got {key!r}"])
        # An unknown namespace would otherwise be ignored silently (a typo such as 'qausi' would drop the
        # user's options), so every key must name a registered mixer: UnknownMixerError with "did you mean".
        owner = spec if normalize_name(key) == normalize_name(spec.name) else default_registry.get_spec(key)
        if not isinstance(value, Mapping):
            raise InvalidMixerOptions(
                owner.name,
                [f"mixer_options[{key!r}] must be a mapping of option names to values "
                 f"(e.g. mixer_options.{key}.<option>=<value>), got {type(value).__name__} {value!r}"],
            )
        if owner.name == spec.name:
            matching.append(key)
            chosen = value
    if len(matching) > 1:
        raise InvalidMixerOptions(
            spec.name,
            [f"options for mixer {spec.name!r} are given under several names ({', '.join(map(repr, matching))}); "
             "keep one of them"],
        )
    if not matching:
        return {}
    options = dict(chosen)
    for name in options:
        if not isinstance(name, str):
            raise InvalidMixerOptions(spec.name, [f"option names must be strings, got {name!r}"])
    if "dim" in options:
        raise InvalidMixerOptions(
            spec.name,
            [f"'dim' is set by the model (its model_dim); remove it from mixer_options[{matching[0]!r}]"],
        )
    return options


def resolve_mixer(
    mixer: str,
    mixer_options: Mapping[str, object] | None,
    *,
    dim: int,
    host_options: Mapping[str, int | None] | None = None,
    causal: bool = False,
) -> ResolvedMixer:
    """Validate ``mixer`` and its namespaced options through the registry.

    Args:
        mixer: a registered mixer name or alias.
        mixer_options: ``{mixer name: {option: value}}``; only the chosen mixer's entry is used.
        dim: the host model's width, the mixer's ``dim``.
        host_options: what the host model knows: ``num_heads`` and ``max_seq_len``; each is used only if the
            mixer's config has a field of that name and the user did not set it. ``None`` values are skipped
            (the mixer's own default applies).
        causal: the host is a decoder: the mixer must run causally (``causal=True`` is filled in where the mixer
            has that option; a bidirectional-only mixer, or ``causal: false`` among the options, is an error).
            Otherwise the host is an encoder, which prefers ``causal=False``.

    Raises:
        UnknownMixerError: ``mixer`` or a ``mixer_options`` key names no registered mixer ("did you mean").
        InvalidMixerOptions: an option is unknown, has a bad value, or the namespaces are malformed.
        PluginLoadError, DuplicateMixerError: the chosen mixer's plugin is broken or its name is ambiguous.
    """
    if not isinstance(mixer, str) or not mixer.strip():
        raise MixerError(f"mixer must be a non-empty mixer name (see `mixer-plugins list`), got {mixer!r}")
    spec = default_registry.get_spec(mixer)
    options = namespaced_options(spec, mixer_options or {})
    known = dict(host_options or {})
    # An encoder prefers a bidirectional mixer: one that can run either way gets causal=False unless the user
    # asks otherwise; causal-only mixers are left as they are. A decoder requires a causal one.
    host = HostModel(dim=dim, num_heads=known.get("num_heads"), max_seq_len=known.get("max_seq_len"),
                     causal=True if causal else None, prefer_causal=None if causal else False,
                     source="the model config", override_hint=f"set them under mixer_options.{spec.name} to override")
    config, from_host = resolve_config(spec, host, options)
    if causal and not getattr(config, "causal", spec.direction == "causal"):
        raise InvalidMixerOptions(spec.name, [
            f"a decoder needs a causal mixer, but mixer_options.{spec.name} sets causal=false; remove it"])
    return ResolvedMixer(spec=spec, config=config, from_host=from_host)


def mixer_problems(
    mixer: str,
    mixer_options: Mapping[str, object] | None,
    *,
    dim: int,
    host_options: Mapping[str, int | None] | None = None,
    causal: bool = False,
) -> list[str]:
    """The messages :func:`resolve_mixer` would raise, as a list (empty when valid); for ``validate()``."""
    try:
        resolve_mixer(mixer, mixer_options, dim=dim, host_options=host_options, causal=causal)
    except MixerError as err:
        return [str(err)]
    return []
