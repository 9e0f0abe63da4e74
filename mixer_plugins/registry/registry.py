"""The mixer registry: discovery through entry points, lazy loading, aliases, clear errors.

* One entry-point group, :data:`ENTRY_POINT_GROUP`: an entry point's name is the mixer's name, its object a
  :class:`~mixer_plugins.registry.spec.MixerSpec`. Our built-in mixers are declared the same way in our
  ``pyproject.toml``.
* Listing names reads entry-point metadata only. A lookup imports only what it must: a built-in's name or alias
  imports no plugin, a plugin mixer's name imports that plugin alone; an alias only a plugin declares (aliases live in
  the specs, not in the metadata) or an unknown name imports every plugin.
* A plugin that fails to import (anything raised, ``SystemExit`` included), or yields something that is not a valid
  spec, is reported with its distribution and error and never breaks the others.
* A key (name or alias) claimed by two specs is an error naming both. The built-ins' names and aliases, and every
  entry point's name, are known without importing plugins and win over an alias a plugin declares: such an alias is
  never used and is reported as an ``alias-conflict``. A plugin therefore never takes over a built-in name or alias.
* A change of torch's process-wide settings (default dtype, thread count, grad mode, deterministic algorithms) made
  while a plugin is imported is undone, with a :class:`~mixer_plugins.MixerPluginWarning` naming the plugin.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any, TypeVar

from .._text import closest
from ..errors import DuplicateMixerError, MixerPluginWarning, PluginLoadError, UnknownMixerError

if TYPE_CHECKING:  # pragma: no cover
    from .spec import MixerSpec

__all__ = ["ENTRY_POINT_GROUP", "IN_PROCESS", "MixerRegistry", "PluginProblem", "make_register_function"]

ENTRY_POINT_GROUP = "mixer_plugins.mixers"
#: The distribution recorded for mixers registered in-process (:meth:`MixerRegistry.register`).
IN_PROCESS = "<in-process>"
#: The distribution of the built-in mixers.
OWN_DISTRIBUTION = "mixer-plugins"
BuilderT = TypeVar("BuilderT", bound=Callable[..., Any])
Listener = Callable[[str, "MixerSpec"], None]


def normalize_name(name: str) -> str:
    """Names are matched case-insensitively, with ``-`` and ``_`` equivalent (``low-rank`` == ``low_rank``)."""
    return name.strip().lower().replace("-", "_")


def _spec_class() -> type[MixerSpec]:
    from .spec import MixerSpec  # imports torch and pydantic: only once a spec is needed

    return MixerSpec


@dataclasses.dataclass
class _Entry:
    name: str
    distribution: str
    target: str
    load: Callable[[], Any]
    spec: MixerSpec | None = None
    error: PluginLoadError | None = None

    @property
    def home(self) -> bool:
        """A built-in or in-process mixer: known without importing any plugin."""
        return self.target == IN_PROCESS or normalize_name(self.distribution) == normalize_name(OWN_DISTRIBUTION)


@dataclasses.dataclass(frozen=True)
class PluginProblem:
    """A broken plugin or a name claimed more than once."""

    name: str
    kind: str  # "broken" | "duplicate" | "alias-conflict"
    message: str
    distributions: tuple[str, ...]


#: A claim on a key: the entry and whether the key is its name (``"mixer"``) or one of its aliases (``"alias"``).
_Claim = tuple[_Entry, str]


def _describe(claim: _Claim) -> str:
    entry, kind = claim
    return f"{entry.distribution} ({'mixer' if kind == 'mixer' else 'alias of'} {entry.name!r})"


def _torch_settings() -> list[tuple[str, Callable[[], Any], Callable[[Any], object]]]:
    """torch's process-wide settings a plugin's import must not change: (what, getter, setter)."""
    import torch

    return [
        ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        ("thread count", torch.get_num_threads, torch.set_num_threads),
        ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        ("deterministic algorithms (enabled, warn_only)",
         lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
         lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
    ]


class MixerRegistry:
    """A registry of mixer specs fed by an entry-point group and by in-process registrations."""

    def __init__(self, group: str = ENTRY_POINT_GROUP):
        self.group = group
        self._lock = threading.RLock()
        self._entries: dict[str, list[_Entry]] | None = None
        self._in_process: dict[str, _Entry] = {}
        self._warned: set[str] = set()
        self._listeners: list[Listener] = []

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event, spec)`` after every in-process registration (``"register"``) and removal
        (``"unregister"``), e.g. so a host library's own name table follows the registry. A listener that raises
        is reported with a :class:`RuntimeWarning` and never undoes the registration."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener`` (no error if it was not added)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self, event: str, spec: MixerSpec) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, spec)
            except Exception as err:  # noqa: BLE001 - a listener never breaks registering
                warnings.warn(f"mixer registry listener {listener!r} failed on {event} {spec.name!r}: "
                              f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)

    def refresh(self) -> None:
        """Forget discovered entry points (e.g. after installing a plugin at run time)."""
        with self._lock:
            self._entries = None
            self._warned.clear()

    def _discover(self) -> dict[str, list[_Entry]]:
        """Every key -> the entries named so (entry points, then in-process registrations)."""
        with self._lock:
            if self._entries is None:
                self._entries = {}
                seen = set()
                for ep in metadata.entry_points(group=self.group):
                    dist = getattr(ep.dist, "name", None) or "<unknown distribution>"
                    if (ep.name, normalize_name(dist), ep.value) in seen:  # one distribution twice on sys.path
                        continue
                    seen.add((ep.name, normalize_name(dist), ep.value))
                    entry = _Entry(ep.name, dist, ep.value, ep.load)
                    self._entries.setdefault(normalize_name(ep.name), []).append(entry)
            merged = {key: list(entries) for key, entries in self._entries.items()}
            for key, entry in self._in_process.items():
                merged.setdefault(key, []).append(entry)
            return merged

    def _load(self, entry: _Entry) -> MixerSpec:
        """The entry's spec, importing its module once; a failure is kept and raised again on every call."""
        if entry.spec is not None:
            return entry.spec
        if entry.error is None:
            spec_class = _spec_class()  # imports torch, so its settings are read before the plugin runs
            settings = _torch_settings()
            before = [get() for _, get, _ in settings]
            problem: BaseException | str | None = None
            try:
                obj = entry.load()
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - any import failure (SystemExit too) is the plugin's
                problem = exc
            finally:
                changed = []
                for (what, get, set_), old in zip(settings, before):
                    if (new := get()) != old:
                        set_(old)
                        changed.append(f"{what} {new} (restored to {old})")
                if changed:
                    warnings.warn(f"importing mixer plugin {entry.name!r} ({entry.target}) of distribution "
                                  f"{entry.distribution!r} changed torch's process-wide settings: "
                                  f"{'; '.join(changed)}. A plugin must not change them when imported; report it "
                                  "to its authors.", MixerPluginWarning, stacklevel=4)
            if problem is None and not isinstance(obj, spec_class):
                problem = f"the entry point must point to a mixer_plugins.MixerSpec, got {type(obj).__name__}"
            elif problem is None and normalize_name(obj.name) != normalize_name(entry.name):
                problem = f"the entry point is named {entry.name!r} but its spec is named {obj.name!r}"
            if problem is None:
                entry.spec = dataclasses.replace(obj, distribution=entry.distribution)
                return entry.spec
            entry.error = PluginLoadError(entry.name, entry.distribution, entry.target, problem)
        raise entry.error from None

    def _claims(self, entries: dict[str, list[_Entry]]) -> tuple[dict[str, list[_Claim]], list[PluginProblem]]:
        """Every key (name or alias) -> its claims, loading every entry; and the entries that failed to load."""
        claims: dict[str, list[_Claim]] = {}
        broken = []
        for key, candidates in sorted(entries.items()):
            for entry in candidates:
                claims.setdefault(key, []).append((entry, "mixer"))
                try:
                    spec = self._load(entry)
                except PluginLoadError as err:
                    broken.append(PluginProblem(entry.name, "broken", str(err), (entry.distribution,)))
                    continue
                for akey in map(normalize_name, spec.aliases):
                    if akey != key and all(e is not entry for e, _ in claims.get(akey, [])):
                        claims.setdefault(akey, []).append((entry, "alias"))
        return claims, broken

    def catalog(self) -> tuple[list[MixerSpec], list[PluginProblem]]:
        """Every loadable spec (sorted by name) and every problem: broken plugins, names claimed twice and
        conflicting aliases. Imports all plugins; warns about nothing."""
        with self._lock:
            entries = self._discover()
            claims, problems = self._claims(entries)
            specs = []
            for _, candidates in sorted(entries.items()):
                if len(candidates) > 1:
                    dists = tuple(c.distribution for c in candidates)
                    message = str(DuplicateMixerError(candidates[0].name, list(dists)))
                    problems.append(PluginProblem(candidates[0].name, "duplicate", message, dists))
                elif candidates[0].spec is not None:
                    specs.append(candidates[0].spec)
            for key, owning in sorted(claims.items()):
                if len(owning) > 1 and any(kind == "alias" for _, kind in owning):
                    message = str(DuplicateMixerError(key, [_describe(c) for c in owning]))
                    dists = tuple(dict.fromkeys(e.distribution for e, _ in owning))
                    problems.append(PluginProblem(key, "alias-conflict", message, dists))
            return specs, problems

    def names(self) -> list[str]:
        """Names of every registered mixer, sorted. Imports no plugin code."""
        return sorted(candidates[0].name for candidates in self._discover().values())

    def specs(self) -> list[MixerSpec]:
        """Every loadable spec (imports all plugins). Broken or duplicate ones are warned about (once) and skipped."""
        with self._lock:
            specs, problems = self.catalog()
            for problem in problems:
                if problem.message not in self._warned:
                    self._warned.add(problem.message)
                    warnings.warn(problem.message, MixerPluginWarning, stacklevel=3)
            return specs

    def problems(self) -> list[PluginProblem]:
        """Broken plugins, duplicated names and conflicting aliases (imports all plugins)."""
        return self.catalog()[1]

    def get_spec(self, name: str) -> MixerSpec:
        """The spec of a mixer, by name or alias (case-insensitive, ``-`` == ``_``).

        Raises :class:`DuplicateMixerError` naming every claimant when the key is claimed more than once (see the
        module docstring for which claims compete), :class:`UnknownMixerError` with "did you mean" when nothing
        claims it, and the plugin's :class:`PluginLoadError` when it fails to load.
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
            home, _ = self._claims({k: [e for e in v if e.home] for k, v in entries.items()})
            owning = home.get(key, [])
            if named and not named[0].home:
                owning = owning + [(named[0], "mixer")]  # a plugin's mixer named like a built-in's alias
            if not owning:  # an alias only a plugin declares, or an unknown name: every plugin is imported
                owning = self._claims(entries)[0].get(key, [])
                if len(owning) < 2:  # the lookup succeeds or fails for want of a name: report what is broken
                    specs = self.specs()
                if not owning:
                    vocabulary = {k: e[0].name for k, e in entries.items()}
                    vocabulary.update({normalize_name(a): a for s in specs for a in s.aliases
                                       if normalize_name(a) not in vocabulary})
                    close = closest(key, vocabulary, n=3)
                    raise UnknownMixerError(name, [vocabulary[c] for c in close], self.names())
            if len(owning) > 1:
                raise DuplicateMixerError(name, [_describe(c) for c in owning])
            return self._load(owning[0][0])

    def create(self, name: str, dim: int | None = None, /, **options: Any) -> Any:
        """Validate ``options`` with the mixer's config model and build the mixer."""
        spec = self.get_spec(name)
        return spec.build(spec.make_config(dim, **options))

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
            self._in_process[key] = _Entry(spec.name, distribution, IN_PROCESS, lambda: spec, spec)
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
        spec_class = _spec_class()
        if isinstance(spec_or_name, spec_class):
            if fields:
                raise TypeError("pass either a MixerSpec or a name with spec fields, not both")
            return registry.register(spec_or_name, replace=replace)
        if not isinstance(spec_or_name, str):
            raise TypeError(f"register_mixer takes a MixerSpec or a name, got {type(spec_or_name).__name__}")

        def decorator(builder: BuilderT) -> BuilderT:
            config = fields.pop("config", None) or getattr(builder, "config_class", None)
            if config is None:
                raise TypeError("register_mixer needs config=<MixerConfig subclass>")
            registry.register(spec_class(name=spec_or_name, config=config, builder=builder, **fields),
                              replace=replace)
            return builder

        return decorator

    return register_mixer
