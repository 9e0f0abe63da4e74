"""What ``mixer-plugins list`` shows of a mixer, and a cache of it that makes listing cheap.

A :class:`MixerInfo` is the printable part of a :class:`~mixer_plugins.registry.spec.MixerSpec` (name, aliases,
matrix class, direction, complexity, ...). Getting it from the spec means importing the module the entry point
names, and with it torch: seconds. :class:`MetadataCache` keeps the infos of the specs that loaded, in a JSON file
per Python environment, so that a later listing imports neither torch, pydantic nor any mixer module.

A cached info is used only while nothing it came from has changed. Its key holds the entry point (name, target,
distribution) and the size and modification time of the module the target names (found without importing it);
the whole file is dropped when any folder on ``sys.path`` changes (installing, upgrading or removing a
distribution changes its folder). A plugin that failed to load is never cached: it is imported, and reported, every
time. The cache lives in ``$MIXER_PLUGINS_CACHE_DIR``, else ``$XDG_CACHE_HOME/mixer-plugins``, else
``~/.cache/mixer-plugins``; a cache that cannot be read or written is ignored.

This module imports neither torch nor pydantic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

__all__ = ["MixerInfo", "MetadataCache", "default_cache_dir", "module_stamp"]

#: Bumped when the file's layout or :class:`MixerInfo`'s fields change (older files are then ignored).
CACHE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class MixerInfo:
    """The printable metadata of one registered mixer (the fields of its spec that ``mixer-plugins list`` shows)."""

    name: str
    aliases: tuple[str, ...] = ()
    summary: str = ""
    matrix_class: str = ""
    direction: str = "bidirectional"
    complexity: str = ""
    data_dependent: str = "yes"
    distribution: str | None = None

    @classmethod
    def from_spec(cls, spec: Any) -> MixerInfo:
        """The metadata of a :class:`~mixer_plugins.registry.spec.MixerSpec` (or anything with its fields)."""
        return cls(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(cls)})

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (aliases as a list)."""
        data = dataclasses.asdict(self)
        data["aliases"] = list(self.aliases)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MixerInfo:
        """The inverse of :meth:`to_json`; raises ``TypeError``/``KeyError`` on a malformed record."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(data) != fields:
            raise KeyError(f"a cached mixer info must have the fields {sorted(fields)}, got {sorted(data)}")
        info = cls(**{**data, "aliases": tuple(data["aliases"])})
        if not isinstance(info.name, str) or not all(isinstance(a, str) for a in info.aliases):
            raise TypeError("malformed cached mixer info")
        return info


def default_cache_dir() -> Path:
    """``$MIXER_PLUGINS_CACHE_DIR``, else ``$XDG_CACHE_HOME/mixer-plugins``, else ``~/.cache/mixer-plugins``."""
    explicit = os.environ.get("MIXER_PLUGINS_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mixer-plugins"


def module_stamp(target: str) -> str | None:
    """``path:size:mtime_ns`` of the file of the module an entry point's target (``module:attr``) names, found
    without importing it (or any parent package); ``None`` when it cannot be found that way (then the entry is not
    cached)."""
    module = target.split(":", 1)[0].strip()
    if not module:
        return None
    search: list[str] | None = None
    spec = None
    parts = module.split(".")
    try:
        for i in range(len(parts)):
            spec = PathFinder.find_spec(".".join(parts[: i + 1]), search)
            if spec is None:
                return None
            search = list(spec.submodule_search_locations or [])
        origin = getattr(spec, "origin", None)
        if not origin or not os.path.isfile(origin):
            return None
        st = os.stat(origin)
    except (ImportError, OSError, ValueError):
        return None
    return f"{origin}:{st.st_size}:{st.st_mtime_ns}"


def _environment_stamp(paths: Iterable[str]) -> str:
    """The modification times of the folders on ``sys.path`` (not the working directory, whose files come and go):
    installing, upgrading or removing a distribution changes one of them."""
    cwd = os.getcwd()
    parts = [sys.version, sys.prefix]
    for entry in paths:
        if not entry or entry == "." or os.path.abspath(entry) == cwd:
            continue
        try:
            parts.append(f"{entry}:{os.stat(entry).st_mtime_ns}")
        except OSError:
            parts.append(f"{entry}:-")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class MetadataCache:
    """The infos of the mixers that loaded, keyed by entry point and module stamp (see the module's docstring).

    Args:
        path: the JSON file; default: one file per Python environment in :func:`default_cache_dir`.
        sys_path: the import path whose folders stamp the environment (default: ``sys.path``).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, sys_path: Iterable[str] | None = None):
        if path is None:
            env = hashlib.sha256(f"{sys.prefix}\n{sys.executable}".encode()).hexdigest()[:16]
            path = default_cache_dir() / f"list-{env}.json"
        self.path = Path(path)
        self.stamp = _environment_stamp(sys.path if sys_path is None else sys_path)

    @staticmethod
    def key(name: str, target: str, distribution: str) -> str | None:
        """The cache key of an entry point, or ``None`` when its module cannot be stamped (never cached)."""
        stamp = module_stamp(target)
        return None if stamp is None else "\0".join((distribution, name, target, stamp))

    def read(self) -> dict[str, MixerInfo]:
        """The cached infos by key; empty when there is no file, it is unreadable or the environment changed."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != CACHE_FORMAT or data.get("environment") != self.stamp:
                return {}
            return {key: MixerInfo.from_json(info) for key, info in data["entries"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}

    def write(self, infos: Mapping[str, MixerInfo]) -> bool:
        """Replace the file with ``infos`` (atomically); returns False (and keeps going) if it cannot be written."""
        data = {"format": CACHE_FORMAT, "environment": self.stamp,
                "entries": {key: info.to_json() for key, info in infos.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.path.name, suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    json.dump(data, handle)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            return False
        return True
