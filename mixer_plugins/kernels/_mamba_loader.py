"""Load mamba-ssm's Triton SSD kernels, also where mamba-ssm's CUDA extensions are missing.

``import mamba_ssm`` runs the package's ``__init__``, which imports its compiled CUDA extensions
(``selective_scan_cuda`` first). A wheel built with ``MAMBA_SKIP_CUDA_BUILD=TRUE`` has none, so the package cannot
be imported, although its SSD kernels (``mamba_ssm/ops/triton/ssd_combined.py`` and the modules it imports) are
plain Python and Triton and need none of it. :func:`load` therefore:

1. imports ``mamba_ssm.<name>`` the ordinary way; when that works (the extensions are there), it is used as is;
2. otherwise it loads the same files from the installed distribution without running any package ``__init__``:
   for the duration of the load, a finder placed first on ``sys.meta_path`` answers every ``mamba_ssm*`` name,
   giving each package (a folder) an empty module whose ``__path__`` is the real folder and each module its real
   file, so that the modules' own absolute imports (``from mamba_ssm.ops.triton.ssd_bmm import ...``) resolve.
   Afterwards every ``mamba_ssm*`` entry of ``sys.modules`` is put back as it was before: the loaded modules are
   kept here only, and a later ``import mamba_ssm`` elsewhere behaves exactly as if this module had never run
   (it fails as before without the extensions, and imports the real package once they are there).

Nothing here runs at import: importing :mod:`mixer_plugins` never imports mamba-ssm. :func:`unavailable_reason`
says, without loading anything, why the kernels cannot be loaded (not installed, Triton or einops missing).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["PACKAGE", "REQUIRED", "distribution_folder", "forget", "load", "loaded_without_init",
           "unavailable_reason"]

PACKAGE = "mamba_ssm"
REQUIRED = ("torch", "triton", "einops", "packaging")
"""The third-party modules that mamba-ssm's Triton SSD modules import at their top."""

_lock = threading.RLock()
_loaded: dict[str, ModuleType] = {}
_failed: dict[str, str] = {}
_without_init: set[str] = set()


def distribution_folder() -> Path | None:
    """The folder of the installed ``mamba_ssm`` package (found without importing it), or ``None``."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):  # a broken entry in sys.modules
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def unavailable_reason() -> str | None:
    """Why mamba-ssm's Triton SSD kernels cannot be loaded here, found without importing them (``None``: they
    may be). Whether the load then works is :func:`load`'s answer."""
    if distribution_folder() is None:
        return ("mamba-ssm is not installed (pip extra 'cuda', or a wheel built with MAMBA_SKIP_CUDA_BUILD=TRUE: "
                "see docs/kernels.md)")
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        return f"mamba-ssm is installed, but its Triton SSD kernels need {', '.join(missing)}, not installed here"
    return None


def loaded_without_init(name: str) -> bool:
    """Whether ``mamba_ssm.<name>`` was loaded from its files, the package ``__init__`` not run (see the module
    notes), rather than imported the ordinary way."""
    return name in _without_init


def load(name: str = "ops.triton.ssd_combined") -> ModuleType:
    """The module ``mamba_ssm.<name>``: imported normally when the package imports, else loaded from the
    installed files without running any package ``__init__`` (see the module notes). Cached.

    Raises :class:`ImportError` saying why when neither works (the first line of each failure); a failure is
    remembered too, so that probing again costs nothing (:func:`forget` clears both).
    """
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _failed:
            raise ImportError(_failed[name])
        reason = unavailable_reason()
        if reason is not None:
            raise ImportError(reason)  # not remembered: installing the package later in the process is seen
        full = f"{PACKAGE}.{name}"
        try:
            module = importlib.import_module(full)
        except Exception as err:  # noqa: BLE001 - the package __init__ may fail in many ways (CUDA extensions)
            ordinary = _first_line(err)
            try:
                module = _load_without_init(full)
            except Exception as fallback:  # noqa: BLE001
                _failed[name] = (f"mamba-ssm's {name} could not be loaded: importing it failed ({ordinary}), and "
                                 f"loading its files without the package __init__ failed too "
                                 f"({_first_line(fallback)})")
                raise ImportError(_failed[name]) from fallback
            _without_init.add(name)
        _loaded[name] = module
        return module


def forget() -> None:
    """Forgets what :func:`load` loaded or failed to load (for tests)."""
    with _lock:
        _loaded.clear()
        _failed.clear()
        _without_init.clear()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


class _PackageWithoutInit(importlib.abc.Loader):
    """Creates a package module whose ``__init__`` is not run: an empty module with the real ``__path__``."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module; the import machinery sets __path__ from the spec

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = f"{module.__name__}: loaded by mixer_plugins without running its __init__"


class _Finder(importlib.abc.MetaPathFinder):
    """Answers ``mamba_ssm`` and its submodules from the distribution's folder, packages without ``__init__``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        where = self.root.joinpath(*fullname.split(".")[1:])
        if where.is_dir():
            spec = importlib.machinery.ModuleSpec(fullname, _PackageWithoutInit(), is_package=True)
            spec.submodule_search_locations = [str(where)]
            return spec
        source = where.with_suffix(".py")
        if source.is_file():
            return importlib.util.spec_from_file_location(fullname, source)
        return None  # not part of the folder (a compiled extension): let the import fail as it would


def _owned(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _load_without_init(full: str) -> ModuleType:
    """Loads ``full`` (a ``mamba_ssm.*`` module) through :class:`_Finder`, then restores every ``mamba_ssm*``
    entry of ``sys.modules`` (and ``sys.meta_path``) to what it was."""
    root = distribution_folder()
    if root is None:  # pragma: no cover - unavailable_reason() said it was there
        raise ImportError("mamba-ssm is not installed")
    saved = {name: module for name, module in sys.modules.items() if _owned(name)}
    for name in saved:  # what a failed ordinary import left behind would otherwise be reused
        del sys.modules[name]
    finder = _Finder(root)
    sys.meta_path.insert(0, finder)
    importlib.invalidate_caches()
    try:
        return importlib.import_module(full)
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if _owned(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
