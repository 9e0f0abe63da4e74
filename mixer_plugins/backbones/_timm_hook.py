"""Register our timm names when timm is imported, without importing timm ourselves.

``import mixer_plugins`` promises that ``timm.create_model('vit_base', mixer='quasi')`` works afterwards, yet the
low layers (``mixer_plugins.kernels``, ``.registry``, ``.mixers``) must not pay for importing timm, and importing them
runs the package root. timm has no plugin discovery of its own, so the root calls :func:`install`:

* if timm is already imported, the adapter (:mod:`mixer_plugins.backbones.timm`) is imported at once;
* otherwise a finder on :data:`sys.meta_path` waits for ``import timm`` and imports the adapter right after timm's own
  ``__init__`` has run. It then removes itself. Nothing of timm is patched: the adapter uses timm's public registries.

This module imports neither timm nor anything of ours at import time.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from types import ModuleType
from typing import Any

__all__ = ["install", "is_registered"]

_ADAPTER = "mixer_plugins.backbones.timm"
_lock = threading.Lock()
_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    try:
        importlib.import_module(_ADAPTER)
    except Exception as err:  # never break the user's `import timm`
        _registered = False
        warnings.warn(f"mixer-plugins could not register its timm models: {type(err).__name__}: {err}",
                      RuntimeWarning, stacklevel=3)


def is_registered() -> bool:
    """Whether our timm model names and ``attn_layer`` keys are registered in this process."""
    return _registered


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps timm's own loader: runs it, then imports our adapter."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        _uninstall()                              # timm is being imported now: the finder's job is done
        module.__loader__ = self._loader          # timm sees its own loader (resources, reloads)
        module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:     # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _TimmFinder(importlib.abc.MetaPathFinder):
    """Finds ``timm`` with the other finders and wraps its loader. It stays installed until timm is actually
    executed: ``importlib.util.find_spec('timm')`` (libraries probing for optional packages do that) finds
    without importing, and must not disarm the hook."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None):
        if fullname != "timm" or getattr(_finding, "active", False):
            return None
        _finding.active = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            for finder in list(sys.meta_path):
                if spec is not None:
                    break
                find = getattr(finder, "find_spec", None)
                if finder is not self and find is not None:
                    spec = find(fullname, path, target)
        finally:
            _finding.active = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RegisterAfterExec(spec.loader)
        return spec


_finding = threading.local()
_finder = _TimmFinder()


def _uninstall() -> None:
    with _lock:
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def install() -> None:
    """Register now if timm is imported, else as soon as it is. Idempotent and thread-safe."""
    if "timm" in sys.modules:
        _register()
        return
    with _lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
