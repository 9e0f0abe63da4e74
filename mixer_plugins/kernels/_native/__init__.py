"""Our native CPU kernels: C++ beside this file, compiled when the package is installed (``setup.py``, with
``torch.utils.cpp_extension``) into the extension ``_C``, whose library registers the :data:`OPS` under
``torch.ops.mixer_plugins_native``: the ``native`` backends of MLR attention, the short convolution, the gated norm,
the scan and the decoding step (each op's ``native`` module), and ``vector_lanes`` (the float32 lanes of the build's
vector code: 16 with AVX-512, 8 with AVX2, 1 for none). Each is called from inside our ``torch.library`` custom ops
or autograd Functions, so ``torch.compile``, ``torch.export`` and ``FlopCounterMode`` see our registered ops.

Nothing is compiled at run time: :func:`load` imports the extension, or says why it cannot (not built: the package
was installed without torch in its build environment or without a C++ compiler; or built for another torch). Then
the callers keep their PyTorch code. ``MIXER_PLUGINS_NATIVE=0`` in the environment never loads it (and, at install,
never builds it).

The matrix products call the BLAS that ``libtorch_cpu`` exports (``sgemm_``/``dgemm_``: MKL in the x86 wheels); the
elementwise loops use ATen's vector types (``at::vec::Vectorized``) at the width the compiler targets.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from typing import Optional

import torch

__all__ = ["ENV_VAR", "OPS", "is_loaded", "library_path", "load", "unavailable_reason"]

#: set to ``0`` (or ``false``/``no``/``off``) to never load the kernels (at install: never build them)
ENV_VAR = "MIXER_PLUGINS_NATIVE"
#: the ops the library registers under ``torch.ops.mixer_plugins_native``
OPS = ("mlr_forward", "mlr_backward", "conv_forward", "conv_backward", "norm_forward", "norm_backward", "scan_forward",
       "scan_backward", "ssd_decode", "vector_lanes")
#: how to build them: the install command that compiles the extension against the installed torch
BUILD_HINT = "pip install --no-build-isolation -e . (or make setup) with a C++17 compiler with OpenMP"
_LOCK = threading.Lock()
_STATE: dict[str, Optional[str] | bool] = {"tried": False, "error": None}


def is_loaded() -> bool:
    """Whether the kernels are loaded in this process (never loads them; safe under ``torch.compile``)."""
    return bool(_STATE["tried"]) and _STATE["error"] is None


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` failed (None if it succeeded or was not tried)."""
    return _STATE["error"]  # type: ignore[return-value]


def library_path() -> Optional[str]:
    """The file of the loaded extension (None when it is not loaded)."""
    if not is_loaded():
        return None
    return str(importlib.import_module(f"{__name__}._C").__file__)


def _import() -> None:  # (its library registers the ops)
    importlib.import_module(f"{__name__}._C")


def load() -> bool:
    """Load the kernels built at install; True when ``torch.ops.mixer_plugins_native`` is ready.

    Thread-safe and tried once per process. Never compiles. Not built: False, with the reason. Built but failing to
    load (e.g. built for another torch): one ``RuntimeWarning`` naming the cause, then False from then on."""
    if _STATE["tried"]:
        return _STATE["error"] is None
    with _LOCK:
        if _STATE["tried"]:
            return _STATE["error"] is None
        error = None
        if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
            error = f"disabled by {ENV_VAR}={os.environ.get(ENV_VAR)}"
        else:
            try:
                _import()
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}._C":
                    raise
                error = f"not built (the package was installed without them; build them with: {BUILD_HINT})"
            except (ImportError, OSError) as exc:  # built, but not for this torch or this machine
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
                warnings.warn(f"mixer_plugins: the native CPU kernels are installed but cannot be loaded ({error}); "
                              f"their PyTorch code runs instead (MLR attention about 1.4x slower, the SSM blocks "
                              f"10-20%). Rebuild them against this torch: {BUILD_HINT}. Set {ENV_VAR}=0 to skip them.",
                              RuntimeWarning, stacklevel=3)
            else:
                missing = [op for op in OPS if not hasattr(torch.ops.mixer_plugins_native, op)]
                if missing:
                    error = f"the installed library registers no {', '.join(missing)} (rebuild it: {BUILD_HINT})"
        _STATE["error"] = error
        _STATE["tried"] = True
        return error is None
