"""The mixer registry: discovery through entry points, lazy loading, aliases, clear errors.

Rules (see the design notes):

* One entry-point group, :data:`ENTRY_POINT_GROUP`. An entry point's name is the mixer's name and its
  object is a :class:`~mixer_plugins.registry.spec.MixerSpec`. Our own built-in mixers are declared the
  same way in our ``pyproject.toml``: one discovery path for everybody. A source checkout put on ``sys.path``
  without being installed (no distribution metadata, so no entry points) reads that table from the checkout's own
  ``pyproject.toml`` instead, so the built-in mixers are there either way.
* Listing names reads entry-point metadata only; a plugin's module is imported the first time its spec
  is needed.
* A plugin that fails to import (or yields something that is not a valid spec) is reported with its
  distribution and error and never breaks the others.
* A name claimed by two distributions is an error naming both; the other names keep working.
* An alias resolves only to the spec that declares it. A key (name or alias) claimed by more than one
  spec -- two aliases, or an alias and another mixer's name -- is ambiguous: looking it up raises
  :class:`~mixer_plugins.DuplicateMixerError` naming every claimant, and :meth:`MixerRegistry.problems`
  reports it. A plugin can therefore never take over a built-in name or alias silently.
* A plugin whose import raises anything (``SystemExit`` included; only ``KeyboardInterrupt`` and
  ``GeneratorExit`` propagate) is reported as broken; it never ends the host process.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._text import closest
from ..errors import (
    DuplicateMixerError,
    MixerPluginWarning,
    PluginLoadError,
    UnknownMixerError,
)
from .metadata import MetadataCache, MixerInfo

if TYPE_CHECKING:  # pragma: no cover
    from .spec import MixerSpec

__all__ = ["ENTRY_POINT_GROUP", "MixerRegistry", "PluginProblem", "IN_PROCESS"]


def _spec_class() -> type[MixerSpec]:
    # spec.py imports torch and pydantic: only when a spec is loaded or checked, never to list names or metadata.
    from .spec import MixerSpec

    return MixerSpec

ENTRY_POINT_GROUP = "mixer_plugins.mixers"
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


OWN_DISTRIBUTION = "mixer-plugins"
SOURCE_CHECKOUT = "mixer-plugins (source checkout)"


def _source_checkout_entry_points(group: str) -> list[metadata.EntryPoint]:
    """The entry points of ``group`` declared by our own ``pyproject.toml`` when this package runs from a source
    checkout that is not installed (our distribution has no metadata); empty otherwise."""
    try:
        metadata.distribution(OWN_DISTRIBUTION)
        return []  # installed (editable or not): its metadata already lists them
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10 has no TOML reader
        return []
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, ValueError):
        return []
    if project.get("name") != OWN_DISTRIBUTION:
        return []
    table = project.get("entry-points", {}).get(group, {})
    return [metadata.EntryPoint(name=name, value=value, group=group) for name, value in table.items()]


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
                found = [(ep, _distribution_name(ep)) for ep in metadata.entry_points(group=self.group)]
                found += [(ep, SOURCE_CHECKOUT) for ep in _source_checkout_entry_points(self.group)]
                for ep, dist in found:
                    key = (ep.name, normalize_name(dist), ep.value)
                    if key in seen:  # the same distribution seen twice on sys.path
                        continue
                    seen.add(key)
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
        try:
            obj = entry.load()
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - any import failure (SystemExit too) is the plugin's, not ours
            entry.error = PluginLoadError(entry.name, entry.distribution, entry.target, exc)
            raise entry.error from None
        if not isinstance(obj, _spec_class()):
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

    def _claims(self, entries: dict[str, list[_Entry]], load: Callable[[_Entry], Any] | None = None,
                loaded: dict[int, Any] | None = None) -> tuple[dict[str, list[_Claim]], list[PluginProblem]]:
        """Every key (name or alias) -> its claimants, and the broken entries. Loads every entry point with
        ``load`` (default: its spec; a broken one is recorded, never raised) and puts what it loaded in ``loaded``
        (by ``id(entry)``)."""
        load = self._load if load is None else load
        claims: dict[str, list[_Claim]] = {}
        broken: list[PluginProblem] = []
        for key, candidates in sorted(entries.items()):
            for entry in candidates:
                claims.setdefault(key, []).append(_Claim(entry.distribution, entry.name, "mixer", entry))
                try:
                    spec = load(entry)
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

    def _all_specs(self, *, warn: bool, load: Callable[[_Entry], Any] | None = None,
                   entries: dict[str, list[_Entry]] | None = None) -> tuple[list[Any], list[PluginProblem]]:
        """Every loadable spec (or what ``load`` makes of an entry) and every problem."""
        entries = self._discover() if entries is None else entries
        loaded: dict[int, Any] = {}
        claims, problems = self._claims(entries, load, loaded)
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

    def catalog(self, *, cache: MetadataCache | bool = True,
                refresh: bool = False) -> tuple[list[MixerInfo], list[PluginProblem]]:
        """The printable metadata of every loadable mixer (sorted by name) and every problem, as
        :meth:`specs` and :meth:`problems` would give them, for listing.

        With a cache (``True``: the default :class:`~mixer_plugins.registry.metadata.MetadataCache`), the metadata
        of a plugin whose module and environment are unchanged since it last loaded is read from the cache: no
        plugin module (nor torch) is imported. Anything else is loaded, which reports broken plugins as
        :meth:`problems` does; the cache is then rewritten. ``refresh=True`` loads everything (and rewrites the
        cache). Never warns: the problems are returned.
        """
        store = MetadataCache() if cache is True else (cache or None)
        cached = {} if store is None or refresh else store.read()
        fresh: dict[str, MixerInfo] = {}

        def load(entry: _Entry) -> MixerInfo:
            key = None if entry.target == IN_PROCESS else \
                MetadataCache.key(entry.name, entry.target, entry.distribution)
            info = None if key is None or entry.spec is not None else cached.get(key)
            if info is None:
                info = MixerInfo.from_spec(self._load(entry))
            if key is not None:
                fresh[key] = info
            return info

        with self._lock:
            infos, problems = self._all_specs(warn=False, load=load)
        if store is not None and fresh != cached:
            store.write(fresh)
        return infos, problems

    def get_spec(self, name: str) -> MixerSpec:
        """The spec of a mixer, by name or alias (case-insensitive, ``-`` == ``_``).

        A key claimed by more than one spec (a name twice, or an alias together with another name or alias)
        raises :class:`DuplicateMixerError` naming every claimant; an alias only ever resolves to the spec that
        declares it.
        """
        if isinstance(name, _spec_class()):
            return name
        if not isinstance(name, str):
            raise TypeError(f"mixer name must be a string, got {type(name).__name__}")
        key = normalize_name(name)
        with self._lock:
            entries = self._discover()
            claims, _ = self._claims(entries)
            owning = claims.get(key, [])
            if len(owning) > 1:
                if all(c.kind == "mixer" for c in owning):  # the same name from two distributions
                    raise DuplicateMixerError(owning[0].spec_name,
                                              [f"{c.distribution} ({c.target})" for c in entries[key]])
                raise DuplicateMixerError(name, [self._describe(c) for c in owning])
            if owning:
                [claim] = owning
                if claim.kind == "alias":  # warn about other problems once, as listing does
                    self._all_specs(warn=True)
                return self._load(claim.entry)
            specs, _ = self._all_specs(warn=True)
            vocabulary = {normalize_name(e[0].name): e[0].name for e in entries.values()}
            for spec in specs:
                for alias in spec.aliases:
                    vocabulary.setdefault(normalize_name(alias), alias)
            close = closest(key, vocabulary, n=3)
            raise UnknownMixerError(name, [vocabulary[c] for c in close], self.names())

    def create(self, name: str, dim: int | None = None, /, **options: Any):
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
            spec = dataclasses.replace(spec, distribution=spec.distribution or IN_PROCESS)
            self._in_process[key] = _Entry(
                name=spec.name, distribution=spec.distribution, target=IN_PROCESS, load=lambda: spec,
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


def make_register_function(registry: MixerRegistry):
    """Build the public ``register_mixer`` bound to ``registry``.

    It takes either a ready :class:`MixerSpec`, or a name plus spec fields and then decorates the builder::

        @register_mixer("my_mixer", config=MyConfig, summary="...")
        class MyMixer(MatrixMixer): ...
    """

    def register_mixer(spec_or_name: MixerSpec | str, *, replace: bool = False, **fields: Any):
        MixerSpec = _spec_class()
        if isinstance(spec_or_name, MixerSpec):
            if fields:
                raise TypeError("pass either a MixerSpec or a name with spec fields, not both")
            return registry.register(spec_or_name, replace=replace)

        def decorator(builder: Callable[[Any], Any]):
            config = fields.pop("config", None) or getattr(builder, "config_class", None)
            if config is None:
                raise TypeError("register_mixer needs config=<MixerConfig subclass>")
            spec = MixerSpec(name=spec_or_name, config=config, builder=builder, **fields)
            registry.register(spec, replace=replace)
            return builder

        return decorator

    return register_mixer
