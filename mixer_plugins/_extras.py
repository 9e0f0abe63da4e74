"""Optional dependencies ("extras"): one clear line naming the install command when one is missing.

Leaf module: imports only :mod:`mixer_plugins.errors`.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from .errors import MissingExtraError

__all__ = ["MissingExtraImportError", "install_command", "require_extra"]


class MissingExtraImportError(MissingExtraError, ImportError):
    """A missing extra met while importing one of our modules: a :class:`MissingExtraError` that is also an
    :class:`ImportError`, so ``pytest.importorskip`` and ``try: import ... except ImportError`` still work."""


def install_command(extra: str) -> str:
    """``pip install 'mixer-plugins[<extra>]'``."""
    return f"pip install 'mixer-plugins[{extra}]'"


def require_extra(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or fail with one line naming ``extra``'s install command.

    Raises :class:`MissingExtraImportError` when ``module`` (or its top-level package) is not installed. When
    this happens while ``python -m`` is locating the module to run (``sys.argv[0] == "-m"``, as Python documents),
    the line is printed on stderr and the process exits with status 2 instead of showing a traceback. An
    installed package that fails to import for another reason raises its own error unchanged.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        top = module.split(".")[0]
        if err.name is not None and err.name not in (module, top) and not module.startswith(err.name + "."):
            raise  # the extra is installed; something it needs is not: its own error says what
        message = f"{what} needs {top}, which is not installed; install the {extra} extra: {install_command(extra)}"
        if sys.argv[:1] == ["-m"]:
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(2) from None
        raise MissingExtraImportError(message) from None
