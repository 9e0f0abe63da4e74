"""What a registry entry is: a :class:`MixerSpec` (metadata + builder) and a :class:`MixerConfig`.

A plugin exposes one ``MixerSpec`` object through the ``mixer_plugins.mixers`` entry-point group.
The spec names a pydantic config model (a :class:`MixerConfig` subclass) that validates every option,
and a builder that turns a validated config into an ``nn.Module`` following the mixer contract
(see :class:`mixer_plugins.MatrixMixer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .._text import did_you_mean
from ..errors import InvalidMixerOptions

__all__ = ["MixerConfig", "MixerSpec", "Direction", "DataDependence"]

Direction = Literal["causal", "bidirectional", "either"]
DataDependence = Literal["yes", "no", "option"]


class MixerConfig(BaseModel):
    """Base class of every mixer's options.

    Subclasses add fields with ``pydantic.Field(default, description=...)``; the description is what
    ``mixer-plugins info NAME`` prints. Configs are immutable and reject unknown options.

    Numbers are checked for what a size or a rate can be: float options must be finite (``inf`` and ``nan``
    are refused, whatever the field's own bounds say) and ``True``/``False`` is not accepted for a number
    (``num_heads=True`` is an error, not 1).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    dim: int = Field(gt=0, description="model width: the mixer maps (batch, length, dim) to (batch, length, dim)")

    @model_validator(mode="before")
    @classmethod
    def _refuse_bools_for_numbers(cls, data: Any) -> Any:
        # pydantic's lax mode takes True as 1 and 1.0; an option that is a number never means a flag.
        if not isinstance(data, Mapping):
            return data
        problems = []
        for key, value in data.items():
            field = cls.model_fields.get(key)
            if isinstance(value, bool) and field is not None and _is_number_not_bool(field.annotation):
                problems.append(f"{key}={value!r}: expected a number, not a bool")
        if problems:
            raise ValueError("; ".join(problems))
        return data


def _annotation_types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (``int | None`` -> {int, NoneType}; Annotated/Literal unwrapped)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _annotation_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_annotation_types(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {type(a) for a in typing.get_args(annotation)}
    return {origin or annotation}


def _is_number_not_bool(annotation: Any) -> bool:
    kinds = _annotation_types(annotation)
    return bool(kinds & {int, float}) and bool not in kinds


#: Substrings of the errors torch raises when an allocation is refused or a size overflows.
_ALLOCATION_FAILURES = ("can't allocate", "cannot allocate", "out of memory", "not enough memory",
                        "allocation", "overflow", "too large", "exceeds", "numel")


def _size_options(config: MixerConfig) -> list[str]:
    """The integer options of ``config``, largest first, as ``name=value``: what makes a mixer big."""
    sizes = [(k, v) for k, v in config if isinstance(v, int) and not isinstance(v, bool)]
    return [f"{k}={v}" for k, v in sorted(sizes, key=lambda kv: -kv[1])]


def _format_validation_error(err: ValidationError) -> list[str]:
    problems = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item.get("loc", ()))
        msg = item.get("msg", "invalid value").removeprefix("Value error, ")  # pydantic's prefix for ValueErrors
        if item.get("type") == "missing":
            problems.append(f"{loc}: required option is missing")
        elif loc:
            problems.append(f"{loc}={item.get('input')!r}: {msg}")
        else:
            problems.append(msg)
    return problems


@dataclasses.dataclass(frozen=True)
class MixerSpec:
    """Registry entry of one mixer.

    Attributes:
        name: canonical name; must equal the entry point's name.
        config: the pydantic model validating the mixer's options (subclass of :class:`MixerConfig`).
        builder: ``builder(config) -> nn.Module``; usually the mixer class itself.
        summary: one line shown by ``mixer-plugins list``.
        aliases: other names accepted by :func:`mixer_plugins.create_mixer`.
        matrix_class: the structured-matrix class of the mixer's L x L matrix (e.g. ``"quasiseparable"``).
        direction: ``"causal"``, ``"bidirectional"`` or ``"either"`` (a ``causal`` option).
        complexity: time complexity in the sequence length, e.g. ``"O(L)"``.
        data_dependent: ``"yes"`` (sequence-aligned), ``"no"`` (free L-sized parameters) or ``"option"``.
        stepping: whether the mixer's causal form decodes token by token (``allocate_cache``, ``prefill``,
            ``step``); the conformance kit checks that prefill + steps equal the forward. False for mixers that
            cannot step (and for bidirectional-only ones).
        test_options: small options used by the conformance kit and ``mixer-plugins show``.
        distribution: the distribution that provided the spec (filled in by the registry).
    """

    name: str
    config: type[MixerConfig]
    builder: Callable[[Any], Any]
    summary: str = ""
    aliases: tuple[str, ...] = ()
    matrix_class: str = ""
    direction: Direction = "bidirectional"
    complexity: str = ""
    data_dependent: DataDependence = "yes"
    stepping: bool = False
    test_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    distribution: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise TypeError(f"MixerSpec.name must be a Python identifier, got {self.name!r}")
        if not (isinstance(self.config, type) and issubclass(self.config, MixerConfig)):
            raise TypeError(f"MixerSpec.config of {self.name!r} must be a MixerConfig subclass, got {self.config!r}")
        if not callable(self.builder):
            raise TypeError(f"MixerSpec.builder of {self.name!r} must be callable")
        if self.direction not in ("causal", "bidirectional", "either"):
            raise TypeError(f"MixerSpec.direction of {self.name!r} must be causal, bidirectional or either")
        if self.data_dependent not in ("yes", "no", "option"):
            raise TypeError(f"MixerSpec.data_dependent of {self.name!r} must be yes, no or option")
        if not isinstance(self.stepping, bool):
            raise TypeError(f"MixerSpec.stepping of {self.name!r} must be a bool")
        if self.stepping and self.direction == "bidirectional":
            raise TypeError(f"MixerSpec.stepping of {self.name!r}: a bidirectional-only mixer cannot step")
        object.__setattr__(self, "aliases", tuple(self.aliases))

    # -- options ---------------------------------------------------------------------------------
    def option_names(self) -> list[str]:
        """The option names, in the config's field order."""
        return list(self.config.model_fields)

    def make_config(self, dim: int | None = None, /, **options: Any) -> MixerConfig:
        """Validate ``options`` with the spec's config model, with "did you mean" for misspelt names."""
        if dim is not None:
            if "dim" in options:
                raise InvalidMixerOptions(self.name, ["dim given twice (positionally and as an option)"])
            options["dim"] = dim
        known = self.option_names()
        problems = []
        for key in options:
            if key not in known:
                problems.append(f"unknown option {key!r}{did_you_mean(key, known)} (options: {', '.join(known)})")
        if problems:
            raise InvalidMixerOptions(self.name, problems)
        try:
            return self.config(**options)
        except ValidationError as err:
            raise InvalidMixerOptions(self.name, _format_validation_error(err)) from None

    def build(self, config: MixerConfig | None = None, /, **options: Any) -> Any:
        """Build the mixer from a validated config, or from options (validated here).

        A module with a ``reset_parameters()`` (every :class:`~mixer_plugins.MatrixMixer`) is then initialised by
        it, from the random state the build started from: under one seed, ``build`` and a later
        ``reset_parameters()`` give the same parameters. Returns what the builder returns: an ``nn.Module`` that
        follows the mixer contract (typed ``Any``, as a plugin's builder need not return a ``MatrixMixer``).
        """
        if config is None:
            config = self.make_config(**options)
        elif options:
            raise TypeError("pass either a config or options, not both")
        elif not isinstance(config, self.config):
            raise InvalidMixerOptions(
                self.name, [f"expected a {self.config.__name__}, got {type(config).__name__}"]
            )
        rng = torch.get_rng_state()
        try:
            module = self.builder(config)
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                torch.set_rng_state(rng)  # the constructor's own draws are replaced by reset_parameters' ones
                with torch.no_grad():
                    reset()
        except (RuntimeError, MemoryError, OverflowError) as err:
            # Huge sizes: say which options make the mixer too big instead of a raw allocator error.
            text = " ".join(str(err).split())
            if not isinstance(err, (MemoryError, OverflowError)) and not any(
                    m in text.lower() for m in _ALLOCATION_FAILURES):
                raise
            sizes = ", ".join(_size_options(config)) or "its options"
            raise InvalidMixerOptions(self.name, [
                f"the mixer cannot be allocated at these sizes ({sizes}); lower the largest one "
                f"({type(err).__name__}: {text[:200]})"
            ]) from None
        # Record where the module came from, so adapters (timm, fairseq2) can serialise it by name.
        with contextlib.suppress(AttributeError):  # builders returning immutable objects
            module.mixer_name = self.name
        return module

    def options_table(self) -> list[tuple[str, str, str, str]]:
        """(name, type, default, help) for every option; used by ``mixer-plugins info``."""
        rows = []
        for fname, field in self.config.model_fields.items():
            default = "(required)" if field.is_required() else repr(field.get_default(call_default_factory=True))
            help_text = field.description or ""
            constraints = [c for c in map(_describe_constraint, field.metadata) if c]
            if constraints:
                help_text = (help_text + " " if help_text else "") + "(" + ", ".join(constraints) + ")"
            rows.append((fname, _type_name(field.annotation), default, help_text))
        return rows


def _type_name(annotation: Any) -> str:
    """Readable type names: ``int | None``, ``list[int]``, ``'a' | 'b'``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


_CONSTRAINT_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "min length",
                       "max_length": "max length", "multiple_of": "multiple of"}


def _describe_constraint(meta: Any) -> str:
    for attr, symbol in _CONSTRAINT_SYMBOLS.items():
        value = getattr(meta, attr, None)
        if value is not None:
            return f"{symbol} {value}"
    return ""
