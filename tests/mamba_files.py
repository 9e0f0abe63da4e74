"""Test and benchmark shim: mamba-ssm's fused SSD imported without running its package ``__init__``.

``import mamba_ssm`` imports its compiled CUDA extensions first; a wheel built with ``MAMBA_SKIP_CUDA_BUILD=TRUE``
has none, so the package cannot be imported, although its SSD (``mamba_ssm/ops/triton/ssd_combined.py`` and what it
imports) is plain Python and Triton. :func:`install` puts empty package modules for ``mamba_ssm``, ``mamba_ssm.ops``
and ``mamba_ssm.ops.triton`` (their ``__path__`` the real folders) into ``sys.modules`` and imports the SSD module
from its file; the library's ``mamba_ssm`` backend then finds it with its ordinary import. The library itself never
does this: without the extensions its backend reports mamba-ssm as unavailable.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

__all__ = ["install"]

SSD_MODULE = "mamba_ssm.ops.triton.ssd_combined"


def install() -> types.ModuleType | None:
    """mamba-ssm's SSD module, importable from now on in this process (None: mamba-ssm is not installed)."""
    try:
        return importlib.import_module(SSD_MODULE)   # the extensions are there: the ordinary import works
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        del sys.modules[name]                         # what the failed import left behind
    spec = importlib.util.find_spec("mamba_ssm")      # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, folder in (("mamba_ssm", root), ("mamba_ssm.ops", root / "ops"),
                         ("mamba_ssm.ops.triton", root / "ops" / "triton")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    return importlib.import_module(SSD_MODULE)
