"""Mixer names and ``--option KEY=VALUE`` assignments from the command line, checked against the registry."""

from __future__ import annotations

import ast
import json
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..._text import did_you_mean
from ...errors import MixerError
from ...registry import default_registry  # cheap: the specs (and torch) load when a mixer is looked up
from .args import CliError

if TYPE_CHECKING:
    from ...registry import MixerSpec

__all__ = ["literal_value", "parse_option_assignments", "resolve_mixers", "typed_option_value"]


def resolve_mixers(names: Sequence[str]) -> list[str]:
    """Canonical names of ``names`` (aliases allowed; ``all`` = every registered mixer), without duplicates; an
    unknown name raises the registry's :class:`~mixer_plugins.MixerError` (with "did you mean")."""
    if list(names) == ["all"]:
        return default_registry.names()
    return list(dict.fromkeys(default_registry.get_spec(name).name for name in names))


def literal_value(raw: str) -> Any:
    """Command-line text as a value: ``none``/``null`` (any case), JSON or a Python literal, else the text itself."""
    if raw.lower() in ("none", "null"):
        return None
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return raw


def typed_option_value(spec: MixerSpec, key: str, raw: str) -> Any:
    """``raw`` (command-line text) as a value of option ``key`` of ``spec``, typed and checked by its config field.

    Numbers, booleans, ``none`` and lists/tuples (``[8,4,2]``, ``1,16``) are parsed, then validated by pydantic
    against the field's type and constraints; a bad value raises :class:`CliError` naming the option.
    """
    from pydantic import TypeAdapter, ValidationError

    fields = spec.config.model_fields
    if key not in fields:
        raise CliError(f"mixer {spec.name!r} has no option {key!r}{did_you_mean(key, list(fields))} "
                       f"(options: {', '.join(fields)})")
    field = fields[key]
    annotation: Any = field.annotation
    if field.metadata:
        params = (annotation, *field.metadata)
        annotation = typing.Annotated[params]  # the field's type with its constraints
    adapter = TypeAdapter(annotation)
    candidates = [literal_value(raw)]
    if "," in raw and not raw.strip().startswith(("[", "(")):
        candidates.append([literal_value(part.strip()) for part in raw.split(",")])
    candidates.append(raw)  # a string option whose value happens to look like a number
    first_error = None
    for candidate in candidates:
        try:
            return adapter.validate_python(candidate)
        except ValidationError as err:
            first_error = first_error or err
    message = first_error.errors()[0]["msg"] if first_error is not None else "invalid value"
    raise CliError(f"invalid value {raw!r} for option {key!r} of mixer {spec.name!r}: {message}")


def parse_option_assignments(assignments: Sequence[str], mixers: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["quasi.d_state=32", "expand=1"]`` -> options per canonical mixer name, typed by each mixer's config.

    ``MIXER.KEY=VALUE`` applies to that mixer (which must be among ``mixers``); a bare ``KEY=VALUE`` applies to
    every mixer in ``mixers`` that has the option (and is an error if none has it).
    """
    out: dict[str, dict[str, Any]] = {name: {} for name in mixers}
    for text in assignments:
        target, sep, raw = text.partition("=")
        if not sep or not target.strip():
            raise CliError(f"--option expects KEY=VALUE or MIXER.KEY=VALUE, got {text!r}")
        target = target.strip()
        if "." in target:
            prefix, key = target.split(".", 1)
            try:
                name = default_registry.get_spec(prefix).name
            except MixerError as err:
                raise CliError(f"--option {text!r}: {err}") from None
            if name not in out:
                raise CliError(f"--option {text!r} names mixer {name!r}, which is not among {', '.join(mixers)}")
            out[name][key] = typed_option_value(default_registry.get_spec(name), key, raw)
        else:
            having = [name for name in mixers if target in default_registry.get_spec(name).config.model_fields]
            if not having:
                if len(mixers) == 1:
                    typed_option_value(default_registry.get_spec(mixers[0]), target, raw)  # "did you mean"
                raise CliError(f"--option {text!r}: none of {', '.join(mixers)} has an option {target!r}")
            for name in having:
                out[name][target] = typed_option_value(default_registry.get_spec(name), target, raw)
    return out
