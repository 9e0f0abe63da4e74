"""The mixer registry: discovery through entry points, lazy loading, aliases, clear errors.

Rules (see the design notes):

* One entry-point group, :data:`ENTRY_POINT_GROUP`. An entry point's name is the mixer's name and its
  object is a :class:`~mixer_plugins.registry.spec.MixerSpec`. Our own built-in mixers are declared the
  same way in our ``pyproject.toml``: one discovery path for everybody.
* Listing names reads entry-point metadata only; a plugin's module is imported the first time its spec
  is needed, and a lookup imports only what it must: a built-in's name or alias imports no plugin, and a plugin
  mixer's name imports that plugin alone. Only an alias declared by a plugin (aliases live in the specs, not in
  the metadata) or an unknown name imports every plugin.
* Importing a plugin must leave torch's process-wide state alone: a change of the default dtype, the thread
  count, the grad mode or the deterministic-algorithms flags made while a plugin's module is imported is undone,
  with a :class:`~mixer_plugins.MixerPluginWarning` naming the plugin's distribution.
* A plugin that fails to import (or yields something that is not a valid spec) is reported with its
  distribution and error and never breaks the others.
* A name claimed by two distributions is an error naming both; the other names keep working.
* An alias resolves only to the spec that declares it. A key claimed by more than one spec is ambiguous: looking
  it up raises :class:`~mixer_plugins.DuplicateMixerError` naming every claimant, and
  :meth:`MixerRegistry.problems` reports it. The built-ins' names and aliases, and every entry point's name, are
  known without importing plugins, so they take precedence over an alias a plugin declares: such an alias is never
  used (it is reported as an ``alias-conflict``). A plugin therefore never takes over a built-in name or alias.
* A plugin whose import raises anything (``SystemExit`` included; only ``KeyboardInterrupt`` and
  ``GeneratorExit`` propagate) is reported as broken; it never ends the host process.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeVar

from .._text import closest
from ..errors import (
    DuplicateMixerError,
    MixerPluginWarning,
    PluginLoadError,
    UnknownMixerError,
)

if TYPE_CHECKING:  # pragma: no cover
    from .spec import MixerSpec

__all__ = ["ENTRY_POINT_GROUP", "MixerRegistry", "PluginProblem", "IN_PROCESS"]


def _spec_class() -> type[MixerSpec]:
    # spec.py imports torch and pydantic: only when a spec is loaded or checked, never to list names or metadata.
    from .spec import MixerSpec

    return MixerSpec

ENTRY_POINT_GROUP = "mixer_plugins.mixers"
#: A mixer builder (usually the mixer class) that ``register_mixer``'s decorator returns unchanged.
BuilderT = TypeVar("BuilderT", bound=Callable[..., Any])
IN_PROCESS = "<in-process>"


def normalize_name(name: str) -> str:
    """Names are matched case-insensitively, with ``-`` and ``_`` equivalent (``low-rank`` == ``low_rank``)."""
    return name.strip().lower().replace("-", "_")


@dataclasses.dataclass
class _Entry:
    name: str
    distribution: str
    target: str
    load: Callable[[], Any]
    spec: MixerSpec | None = None
    error: PluginLoadError | None = None


@dataclasses.dataclass(frozen=True)
class _Claim:
    """One spec's claim on a key: its name (``kind="mixer"``) or one of its aliases."""

    distribution: str
    spec_name: str
    kind: str  # "mixer" | "alias"
    entry: _Entry


@dataclasses.dataclass(frozen=True)
class PluginProblem:
    """A broken plugin or a name claimed more than once."""

    name: str
    kind: str  # "broken" | "duplicate" | "alias-conflict"
    message: str
    distributions: tuple[str, ...]


#: The distribution of the built-in mixers.
OWN_DISTRIBUTION = "mixer-plugins"


def _is_home(entry: _Entry) -> bool:
    """Whether ``entry`` is a built-in mixer or an in-process registration (known without importing a plugin)."""
    return entry.target == IN_PROCESS or normalize_name(entry.distribution) == normalize_name(OWN_DISTRIBUTION)


# torch's process-wide settings a plugin's import must not change: (what it is called, getter, setter).
def _torch_settings() -> list[tuple[str, Callable[[], Any], Callable[[Any], object]]]:
    import torch

    return [
        ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("thread count", torch.get_num_threads, torch.set_num_threads),
        ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        ("deterministic algorithms (enabled, warn_only)",
         lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
         lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
    ]


def _restore_torch_settings(before: list[Any]) -> list[str]:
    """Put back every torch setting that differs from ``before`` (as read by :func:`_torch_settings`); describe
    each one that changed."""
    changed = []
    for (what, get, set_), old in zip(_torch_settings(), before):
        new = get()
        if new != old:
            set_(old)
            changed.append(f"{what} {new} (restored to {old})")
    return changed


def _distribution_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>"
    try:
        return dist.metadata["Name"] or dist.name
    except Exception:  # pragma: no cover - malformed metadata
        return getattr(dist, "name", "<unknown distribution>")


class MixerRegistry:
    """A registry of mixer specs fed by an entry-point group and by in-process registrations."""

    def __init__(self, group: str = ENTRY_POINT_GROUP):
        self.group = group
        self._lock = threading.RLock()
        self._entries: dict[str, list[_Entry]] | None = None
        self._in_process: dict[str, _Entry] = {}
        self._warned: set[tuple[str, str]] = set()
        self._listeners: list[Callable[[str, MixerSpec], None]] = []

    # -- listeners ------------------------------------------------------------------------------
    def add_listener(self, listener: Callable[[str, MixerSpec], None]) -> None:
        """Call ``listener(event, spec)`` after every in-process registration (``event == "register"``) and
        removal (``"unregister"``), e.g. so a host library's own name table follows the registry. A listener
        that raises is reported with a :class:`RuntimeWarning` and never undoes the registration."""
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[str, MixerSpec], None]) -> None:
        """Stop calling ``listener`` (no error if it was not added)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _notify(self, event: str, spec: MixerSpec) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, spec)
            except Exception as err:  # noqa: BLE001 - a listener never breaks registering
                warnings.warn(f"mixer registry listener {listener!r} failed on {event} {spec.name!r}: "
                              f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)

    # -- discovery -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Forget discovered entry points (e.g. after installing a plugin at run time)."""
        with self._lock:
            self._entries = None
            self._warned.clear()

    def _discover(self) -> dict[str, list[_Entry]]:
        with self._lock:
            if self._entries is None:
                entries: dict[str, list[_Entry]] = {}
                seen: set[tuple[str, str, str]] = set()
                for ep in metadata.entry_points(group=self.group):
                    dist = _distribution_name(ep)
                    ident = (ep.name, normalize_name(dist), ep.value)
                    if ident in seen:  # the same distribution seen twice on sys.path
                        continue
                    seen.add(ident)
                    entries.setdefault(normalize_name(ep.name), []).append(
                        _Entry(name=ep.name, distribution=dist, target=ep.value, load=ep.load)
                    )
                self._entries = entries
            merged = {k: list(v) for k, v in self._entries.items()}
            for key, entry in self._in_process.items():
                merged.setdefault(key, []).append(entry)
            return merged

    # -- loading -------------------------------------------------------------------------------
    def _load(self, entry: _Entry) -> MixerSpec:
        if entry.spec is not None:
            return entry.spec
        if entry.error is not None:
            raise entry.error
        spec_class = _spec_class()  # imports torch, so torch's settings are read before the plugin runs
        before = [get() for _, get, _ in _torch_settings()]
        try:
            obj = entry.load()
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - any import failure (SystemExit too) is the plugin's, not ours
            entry.error = PluginLoadError(entry.name, entry.distribution, entry.target, exc)
            raise entry.error from None
        finally:
            changed = _restore_torch_settings(before)
            if changed:
                warnings.warn(f"importing mixer plugin {entry.name!r} ({entry.target}) of distribution "
                              f"{entry.distribution!r} changed torch's process-wide settings: {'; '.join(changed)}. "
                              "A plugin must not change them when imported; report it to its authors.",
                              MixerPluginWarning, stacklevel=4)
        if not isinstance(obj, spec_class):
            entry.error = PluginLoadError(
                entry.name, entry.distribution, entry.target,
                f"the entry point must point to a mixer_plugins.MixerSpec, got {type(obj).__name__}",
            )
            raise entry.error
        if normalize_name(obj.name) != normalize_name(entry.name):
            entry.error = PluginLoadError(
                entry.name, entry.distribution, entry.target,
                f"the entry point is named {entry.name!r} but its spec is named {obj.name!r}",
            )
            raise entry.error
        entry.spec = dataclasses.replace(obj, distribution=entry.distribution)
        return entry.spec

    def _claims(self, entries: dict[str, list[_Entry]],
                loaded: dict[int, Any] | None = None) -> tuple[dict[str, list[_Claim]], list[PluginProblem]]:
        """Every key (name or alias) -> its claimants, and the broken entries. Loads every entry point's spec (a
        broken one is recorded, never raised) and puts what it loaded in ``loaded`` (by ``id(entry)``)."""
        claims: dict[str, list[_Claim]] = {}
        broken: list[PluginProblem] = []
        for key, candidates in sorted(entries.items()):
            for entry in candidates:
                claims.setdefault(key, []).append(_Claim(entry.distribution, entry.name, "mixer", entry))
                try:
                    spec = self._load(entry)
                except PluginLoadError as err:
                    broken.append(PluginProblem(entry.name, "broken", str(err), (entry.distribution,)))
                    continue
                if loaded is not None:
                    loaded[id(entry)] = spec
                for alias in spec.aliases:
                    claim = _Claim(entry.distribution, spec.name, "alias", entry)
                    akey = normalize_name(alias)
                    if akey == key or any(c.entry is entry for c in claims.get(akey, [])):
                        continue  # a spec repeating its own name or alias claims nothing more
                    claims.setdefault(akey, []).append(claim)
        return claims, broken

    @staticmethod
    def _describe(claim: _Claim) -> str:
        kind = "mixer" if claim.kind == "mixer" else "alias of"
        return f"{claim.distribution} ({kind} {claim.spec_name!r})"

    def _all_specs(self, *, warn: bool) -> tuple[list[Any], list[PluginProblem]]:
        """Every loadable spec and every problem."""
        entries = self._discover()
        loaded: dict[int, Any] = {}
        claims, problems = self._claims(entries, loaded)
        specs: list[Any] = []
        for _key, candidates in sorted(entries.items()):
            if len(candidates) > 1:
                err = DuplicateMixerError(candidates[0].name, [c.distribution for c in candidates])
                problems.append(
                    PluginProblem(candidates[0].name, "duplicate", str(err),
                                  tuple(c.distribution for c in candidates))
                )
            elif id(candidates[0]) in loaded:
                specs.append(loaded[id(candidates[0])])
        # Aliases must be unambiguous too: an alias claimed twice, or an alias that is another mixer's name.
        for key, owning in sorted(claims.items()):
            if len(owning) > 1 and any(c.kind == "alias" for c in owning):
                message = str(DuplicateMixerError(key, [self._describe(c) for c in owning]))
                problems.append(PluginProblem(key, "alias-conflict", message,
                                              tuple(dict.fromkeys(c.distribution for c in owning))))
        if warn:
            for problem in problems:
                marker = (problem.name, problem.message)
                if marker not in self._warned:
                    self._warned.add(marker)
                    warnings.warn(problem.message, MixerPluginWarning, stacklevel=3)
        return specs, problems

    # -- public API ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Names of every registered mixer, sorted. Imports no plugin code."""
        return sorted(candidates[0].name for candidates in self._discover().values())

    def specs(self) -> list[MixerSpec]:
        """Every loadable spec (imports all plugins). Broken or duplicate ones are warned about and skipped."""
        with self._lock:
            return self._all_specs(warn=True)[0]

    def problems(self) -> list[PluginProblem]:
        """Broken plugins, duplicated names and conflicting aliases (imports all plugins)."""
        with self._lock:
            return self._all_specs(warn=False)[1]

    def catalog(self) -> tuple[list[MixerSpec], list[PluginProblem]]:
        """Every loadable spec (sorted by name) and every problem, in one pass and without warning, as
        :meth:`specs` and :meth:`problems` give them (imports all plugins); for listing them."""
        with self._lock:
            return self._all_specs(warn=False)

    def get_spec(self, name: str) -> MixerSpec:
        """The spec of a mixer, by name or alias (case-insensitive, ``-`` == ``_``).

        Imports only what the lookup needs: a built-in's name or alias imports no plugin, a plugin mixer's name
        imports that plugin alone; an alias that only a plugin declares imports every plugin (aliases live in the
        specs). A key claimed by more than one spec (a name twice, or an alias together with another name or
        alias) raises :class:`DuplicateMixerError` naming every claimant, except that a plugin's alias never
        competes with a built-in's name or alias or with an entry point's name: those win, and the alias is
        reported by :meth:`problems`. An alias only ever resolves to the spec that declares it.
        """
        if isinstance(name, _spec_class()):
            return name
        if not isinstance(name, str):
            raise TypeError(f"mixer name must be a string, got {type(name).__name__}")
        key = normalize_name(name)
        with self._lock:
            entries = self._discover()
            named = entries.get(key, [])
            if len(named) > 1:  # the same name from two distributions: known from the metadata alone
                raise DuplicateMixerError(named[0].name, [f"{e.distribution} ({e.target})" for e in named])
            # The built-ins' and in-process names and aliases: our own modules, no plugin.
            home = {k: [e for e in v if _is_home(e)] for k, v in entries.items()}
            home_claims, _ = self._claims({k: v for k, v in home.items() if v})
            owning = home_claims.get(key, [])
            if named and not _is_home(named[0]) and owning:  # a plugin mixer named like a built-in's alias
                raise DuplicateMixerError(name, [self._describe(c) for c in owning]
                                          + [f"{named[0].distribution} (mixer {named[0].name!r})"])
            if len(owning) > 1:
                raise DuplicateMixerError(name, [self._describe(c) for c in owning])
            if owning:
                return self._load(owning[0].entry)
            if named:  # a plugin's own name: only its distribution is imported
                return self._load(named[0])
            # An alias declared by a plugin, or an unknown name: every plugin is imported.
            claims, _ = self._claims(entries)
            owning = claims.get(key, [])
            if len(owning) > 1:
                raise DuplicateMixerError(name, [self._describe(c) for c in owning])
            if owning:
                self._all_specs(warn=True)  # warn about other problems once, as listing does
                return self._load(owning[0].entry)
            specs, _ = self._all_specs(warn=True)
            vocabulary = {normalize_name(e[0].name): e[0].name for e in entries.values()}
            for spec in specs:
                for alias in spec.aliases:
                    vocabulary.setdefault(normalize_name(alias), alias)
            close = closest(key, vocabulary, n=3)
            raise UnknownMixerError(name, [vocabulary[c] for c in close], self.names())

    def create(self, name: str, dim: int | None = None, /, **options: Any) -> Any:
        """Validate ``options`` with the mixer's config model and build the mixer."""
        spec = self.get_spec(name)
        config = spec.make_config(dim, **options)
        return spec.build(config)

    def register(self, spec: MixerSpec, *, replace: bool = False) -> MixerSpec:
        """Register a spec in this process only (notebooks, tests). Entry points are the way to ship one."""
        if not isinstance(spec, _spec_class()):
            raise TypeError(f"register() takes a MixerSpec, got {type(spec).__name__}")
        key = normalize_name(spec.name)
        with self._lock:
            existing = self._discover().get(key, [])
            if existing and not replace:
                raise DuplicateMixerError(spec.name, [e.distribution for e in existing] + [IN_PROCESS])
            if replace and self._entries is not None:
                self._entries.pop(key, None)
            distribution = spec.distribution or IN_PROCESS
            spec = dataclasses.replace(spec, distribution=distribution)
            self._in_process[key] = _Entry(
                name=spec.name, distribution=distribution, target=IN_PROCESS, load=lambda: spec,
                spec=spec,
            )
        self._notify("register", spec)
        return spec

    def unregister(self, name: str) -> None:
        """Remove an in-process registration (entry points cannot be removed at run time)."""
        key = normalize_name(name)
        with self._lock:
            if key not in self._in_process:
                raise UnknownMixerError(name, known=sorted(e.name for e in self._in_process.values()))
            entry = self._in_process.pop(key)
            self.refresh()
        if entry.spec is not None:
            self._notify("unregister", entry.spec)


def make_register_function(registry: MixerRegistry) -> Callable[..., Any]:
    """Build the public ``register_mixer`` bound to ``registry``.

    It takes either a ready :class:`MixerSpec`, or a name plus spec fields and then decorates the builder::

        @register_mixer("my_mixer", config=MyConfig, summary="...")
        class MyMixer(MatrixMixer): ...
    """

    def register_mixer(spec_or_name: MixerSpec | str, *, replace: bool = False,
                       **fields: Any) -> MixerSpec | Callable[[BuilderT], BuilderT]:
        MixerSpec = _spec_class()
        if isinstance(spec_or_name, MixerSpec):
            if fields:
                raise TypeError("pass either a MixerSpec or a name with spec fields, not both")
            return registry.register(spec_or_name, replace=replace)
        if not isinstance(spec_or_name, str):
            raise TypeError(f"register_mixer takes a MixerSpec or a name, got {type(spec_or_name).__name__}")
        name = spec_or_name

        def decorator(builder: BuilderT) -> BuilderT:
            config = fields.pop("config", None) or getattr(builder, "config_class", None)
            if config is None:
                raise TypeError("register_mixer needs config=<MixerConfig subclass>")
            spec = MixerSpec(name=name, config=config, builder=builder, **fields)
            registry.register(spec, replace=replace)
            return builder

        return decorator

    return register_mixer
