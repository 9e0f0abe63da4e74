"""Fill a mixer's options from the host model: the one resolver every adapter and tool uses.

A host model knows things a mixer cannot: its width, its head count, how long its sequences are, which direction
it runs in, whether its attention had biases or dropout. :class:`HostModel` holds those facts; :func:`host_options`
turns them into options of one particular mixer, and :func:`resolve_config` validates the result. The timm adapter,
the fairseq2 adapter, the benchmarks (``mixer-plugins bench``, ``show``, ``flops``) and the demo all go through it.

Every decision is made from the mixer's spec and its config fields, never from its name:

* ``dim`` is always the host's width (a ``dim`` among the user's options is refused).
* ``num_heads`` goes to a ``num_heads`` field; with ``derive_head_dim=True`` a mixer sized by ``head_dim`` instead
  gets the head size that gives it the host's head count (:func:`head_dim_for`).
* ``max_seq_len`` goes to a ``max_seq_len`` field (data-independent mixers need it; data-dependent ones ignore it).
* ``causal`` is a direction the host *requires*: it goes to a ``causal`` field, and a mixer without that field
  that runs only the other way is refused (:func:`direction_problem`). ``prefer_causal`` is a direction the host
  merely prefers (an encoder prefers bidirectional): it goes to a ``causal`` field and is otherwise dropped.
* ``qkv_bias``, ``out_bias`` and ``num_prefix_tokens`` go to fields of the same name; ``attn_drop`` to
  ``attn_drop`` or ``dropout``; ``qk_norm`` and ``scale_norm`` to fields of the same name. The last three only
  when they switch something on (forwarding "off" would override a mixer's own default), and a switched-on
  feature the mixer has no option for is warned about.

The user's options always win, and a fact the host does not know (``None``) leaves the mixer's own default.

This module imports neither timm nor fairseq2.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidMixerOptions, MixerError
from ..registry import MixerConfig, MixerSpec

__all__ = ["HostModel", "ResolvedOptions", "direction_problem", "head_dim_for", "host_options", "resolve_config"]

# Host fact -> the config fields that receive it (the first one the mixer has). Insertion order is the order
# facts are filled in, and so the order they are named in messages.
_TARGETS: dict[str, tuple[str, ...]] = {
    "num_heads": ("num_heads",),
    "max_seq_len": ("max_seq_len",),
    "causal": ("causal",),
    "prefer_causal": ("causal",),
    "qkv_bias": ("qkv_bias",),
    "out_bias": ("out_bias",),
    "attn_drop": ("attn_drop", "dropout"),
    "qk_norm": ("qk_norm",),
    "scale_norm": ("scale_norm",),
    "num_prefix_tokens": ("num_prefix_tokens",),
}
# Facts that only matter when they switch a feature on; a mixer that cannot honour them is warned about.
_ONLY_WHEN_SET = frozenset({"attn_drop", "qk_norm", "scale_norm"})


@dataclasses.dataclass(frozen=True)
class HostModel:
    """What a host model knows about the slot a mixer fills; ``None`` means "not known, keep the mixer's own".

    Attributes:
        dim: the host's width, the mixer's ``dim``.
        num_heads: the host's head count.
        max_seq_len: the longest sequence the host runs (its token count).
        causal: the direction the host requires (True: causal, False: bidirectional).
        prefer_causal: the direction the host prefers where the mixer has the choice.
        qkv_bias, out_bias: whether the host's attention had input / output projection biases.
        attn_drop: the host attention's dropout probability.
        qk_norm, scale_norm: whether the host's attention normalised q/k or its output.
        num_prefix_tokens: class/register tokens in front of the sequence.
        source: how messages name the host (e.g. ``"the timm model"``); ``None``: errors add no note about
            which options came from the host.
        override_hint: appended to that note, saying how the user overrides the host's values.
    """

    dim: int
    num_heads: int | None = None
    max_seq_len: int | None = None
    causal: bool | None = None
    prefer_causal: bool | None = None
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    attn_drop: float | None = None
    qk_norm: bool | None = None
    scale_norm: bool | None = None
    num_prefix_tokens: int | None = None
    source: str | None = None
    override_hint: str = ""


@dataclasses.dataclass(frozen=True)
class ResolvedOptions:
    """The options of one mixer in one host: ``options`` (host facts, then the user's on top) and, of those,
    ``from_host`` (filled in from the host, by option name, in the order they were filled)."""

    options: Mapping[str, Any]
    from_host: Mapping[str, Any]


def direction_problem(spec: MixerSpec, causal: bool | None) -> str | None:
    """Why the mixer of ``spec`` cannot run in the required direction (``causal=True``/``False``), or None.

    A mixer with a ``causal`` option runs either way; one without it runs only in its spec's direction.
    """
    if causal is None or "causal" in spec.config.model_fields:
        return None
    if causal and spec.direction != "causal":
        return f"mixer {spec.name!r} is {spec.direction} only; it has no causal form"
    if not causal and spec.direction == "causal":
        return f"mixer {spec.name!r} is causal only; it has no bidirectional form"
    return None


def head_dim_for(spec: MixerSpec, dim: int, num_heads: int,
                 options: Mapping[str, Any] | None = None) -> tuple[str, int] | None:
    """The head size that gives a mixer sized by head width exactly ``num_heads`` heads, as ``("head_dim", value)``.

    Only for mixers with a ``head_dim`` field and no ``num_heads`` field; the inner width is ``expand * dim`` where
    the mixer has ``expand`` (the user's ``expand`` if given), else ``dim``. None when the inner width is not a
    multiple of ``num_heads``.
    """
    fields = spec.config.model_fields
    if "head_dim" not in fields or "num_heads" in fields or num_heads <= 0:
        return None
    expand = 1
    if "expand" in fields:
        expand = (options or {}).get("expand", fields["expand"].get_default(call_default_factory=True))
    if not isinstance(expand, int) or expand <= 0 or (expand * dim) % num_heads:
        return None
    return "head_dim", expand * dim // num_heads


def host_options(spec: MixerSpec, host: HostModel, options: Mapping[str, Any] | None = None, *,
                 derive_head_dim: bool = False) -> ResolvedOptions:
    """The mixer's options in ``host``: the host's facts where the mixer has a matching field, the user's
    ``options`` on top (see the module docstring for the rules).

    Raises :class:`InvalidMixerOptions` for a ``dim`` among ``options`` and :class:`MixerError` when the host
    requires a direction the mixer does not have. Warns (``UserWarning``) about switched-on host features the
    mixer has no option for; they are ignored.
    """
    user = dict(options or {})
    if "dim" in user:
        raise InvalidMixerOptions(spec.name, [f"dim is set by {host.source or 'the host model'}; do not pass it"])
    problem = direction_problem(spec, host.causal)
    if problem:
        raise MixerError(problem)
    fields = spec.config.model_fields
    from_host: dict[str, Any] = {}
    for fact, targets in _TARGETS.items():
        value = getattr(host, fact)
        if value is None or (fact in _ONLY_WHEN_SET and not value):
            continue
        target = next((name for name in targets if name in fields), None)
        if target is None:
            if fact in _ONLY_WHEN_SET:
                warnings.warn(f"{host.source or 'the host model'} asks for {fact}={value!r}, but mixer "
                              f"{spec.name!r} has no such option; it is ignored", UserWarning, stacklevel=3)
            continue
        if target not in user and target not in from_host:
            from_host[target] = value
    if derive_head_dim and host.num_heads is not None:
        derived = head_dim_for(spec, host.dim, host.num_heads, user)
        if derived is not None and derived[0] not in user:
            from_host[derived[0]] = derived[1]
    return ResolvedOptions(options={**from_host, **user}, from_host=from_host)


def resolve_config(spec: MixerSpec, host: HostModel, options: Mapping[str, Any] | None = None, *,
                   derive_head_dim: bool = False) -> tuple[MixerConfig, Mapping[str, Any]]:
    """The mixer's validated config in ``host`` (:func:`host_options`, then the mixer's config model), and the
    options that came from the host.

    When validation fails and ``host.source`` is set, the error says which values came from the host and
    (``host.override_hint``) how to override them.
    """
    resolved = host_options(spec, host, options, derive_head_dim=derive_head_dim)
    try:
        config = spec.make_config(host.dim, **resolved.options)
    except InvalidMixerOptions as err:
        if not resolved.from_host or host.source is None:
            raise
        given = ", ".join(f"{k}={v!r}" for k, v in resolved.from_host.items())
        note = f"note: {given} came from {host.source}" + (f"; {host.override_hint}" if host.override_hint else "")
        raise InvalidMixerOptions(spec.name, [*err.problems, note]) from None
    return config, resolved.from_host
