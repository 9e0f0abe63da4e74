"""Our native CPU kernels: C++ beside this file (``mlr_attention.cpp``, ``conv.cpp``, ``norm.cpp``, ``scan.cpp``,
``common.h``), compiled on first use into one library that registers ``torch.ops.mixer_plugins_native``.

* ``mlr_forward`` / ``mlr_backward``: fused MLR attention, each group of levels at its own score width (the
  ``native`` engine of ``kernels.mlr_attention``'s ``torch`` backend, :mod:`..mlr_attention.native`);
* ``conv_forward`` / ``conv_backward``: the depthwise short convolution with SiLU fused (what the ``torch`` backend
  of ``kernels.depthwise_conv1d`` runs on CPU float32/float64 once built, see :mod:`..conv.torch`);
* ``norm_forward`` / ``norm_backward``: the gated RMSNorm (what the ``torch`` backend of ``kernels.gated_rmsnorm``
  runs on CPU float32/float64, see :mod:`..norm.torch`);
* ``scan_factored_forward`` / ``scan_factored_backward`` (and ``scan_forward`` / ``scan_backward``, the exact form
  for wide decay ranges): the chunked (bi)directional scan, for eager CPU float32/float64 scans of up to 128
  chunks (see :mod:`.._scan.native`).

Each is called from inside our ``torch.library`` custom ops or autograd Functions, so ``torch.compile``,
``torch.export`` and ``FlopCounterMode`` see the same ops as before, whichever code runs inside.

**Build.** :func:`load` compiles the kernels with :func:`torch.utils.cpp_extension.load` (a C++17 compiler with
OpenMP and ``ninja`` are needed; about 15 s, once per CPU model and torch version: the result is cached in torch's
extension folder, ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, under a name that carries the CPU's
instruction-set flags, so a cache shared by different machines never loads a build made for another CPU). The
matrix products call the BLAS that ``libtorch_cpu`` exports (``sgemm_``/``dgemm_``: MKL in the x86 wheels); the
elementwise loops use AVX-512 or AVX2 where the compiler targets them (``-march=native``). If the build or the load
fails, one ``RuntimeWarning`` says why and the callers keep their PyTorch code. ``MIXER_PLUGINS_NATIVE=0`` in the
environment never builds it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = ["ENV_VAR", "OPS", "SOURCES", "is_loaded", "load", "takes", "unavailable_reason"]

#: set to ``0`` (or ``false``/``no``/``off``) to never build the kernel
ENV_VAR = "MIXER_PLUGINS_NATIVE"
#: the ops the library registers under ``torch.ops.mixer_plugins_native``
OPS = ("mlr_forward", "mlr_backward", "conv_forward", "conv_backward", "norm_forward", "norm_backward", "scan_forward",
       "scan_backward", "pool_stats", "pool_release")
#: the C++ sources of the library (``common.h`` is included by each)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("mlr_attention.cpp", "conv.cpp", "norm.cpp", "scan.cpp",
                                                                 "pool.cpp"))
_LOCK = threading.Lock()
_STATE: dict[str, Optional[str] | bool] = {"tried": False, "error": None}
_log = logging.getLogger(__name__)


def _disabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's vendor, family, model and instruction-set flags (Linux's
    ``/proc/cpuinfo``; elsewhere what :mod:`platform` says)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]  # the first processor's entry
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keys = ("vendor_id", "cpu family", "model", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in keys)


def _module_name() -> str:
    """One build per torch version, CPU capability, exact CPU (the kernels are compiled with ``-march=native``: a
    build cache shared by machines with different CPUs, such as a network home directory, must never hand one of them
    code with instructions it lacks) and version of the sources (two versions of this package on one machine never
    load each other's build)."""
    digest = hashlib.sha1()
    for path in (*SOURCES, Path(__file__).with_name("common.h")):
        digest.update(path.read_bytes())
    digest.update(_cpu_identity().encode())
    tag = f"{torch.__version__}_{torch.backends.cpu.get_cpu_capability()}_{digest.hexdigest()[:10]}"
    return "mixer_plugins_native_" + re.sub(r"[^0-9A-Za-z]+", "_", tag).lower()


def is_loaded() -> bool:
    """Whether the kernels are built and registered in this process (never builds; safe under ``torch.compile``)."""
    return bool(_STATE["tried"]) and _STATE["error"] is None


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` failed (None if it succeeded or was not tried)."""
    return _STATE["error"]  # type: ignore[return-value]


def load() -> bool:
    """Build (once per machine) and load the kernels; True when ``torch.ops.mixer_plugins_native`` is ready.

    Thread-safe and tried once per process: a failure warns once and returns False from then on."""
    if _STATE["tried"]:
        return _STATE["error"] is None
    with _LOCK:
        if _STATE["tried"]:
            return _STATE["error"] is None
        error = None
        if _disabled():
            error = f"disabled by {ENV_VAR}={os.environ.get(ENV_VAR)}"
        else:
            try:
                _build()
            except Exception as exc:  # noqa: BLE001  (a compiler, linker or loader failure of any kind)
                error = f"{type(exc).__name__}: {_summary(str(exc))}"
                warnings.warn(f"mixer_plugins: the native CPU kernels (fused MLR attention, the scan, the short "
                              f"convolution, the gated norm) could not be built or loaded ({error}); their PyTorch "
                              f"code runs instead (MLR attention about 1.4x slower, the SSM blocks 10-20%). They "
                              f"need a C++17 compiler with OpenMP and ninja; set {ENV_VAR}=0 to skip the build.",
                              RuntimeWarning, stacklevel=3)
        _STATE["error"] = error
        _STATE["tried"] = True
        return error is None


def takes(*tensors: torch.Tensor) -> bool:
    """Whether a native kernel may run on ``tensors``: all CPU tensors of one dtype, float32 or float64, and the
    library built (the first such call builds it). The gate every caller shares; each adds its own layout checks."""
    first = tensors[0]
    return (first.device.type == "cpu" and first.dtype in (torch.float32, torch.float64)
            and all(t.device == first.device and t.dtype == first.dtype for t in tensors[1:]) and load())


def _summary(message: str) -> str:
    """The line of a build failure that says what went wrong (a compiler's ``error:`` line if any), shortened."""
    lines = [" ".join(line.split()) for line in message.splitlines() if line.strip()]
    causes = [line for line in lines if re.search(r"error:|not found|no such file|undefined symbol", line, re.I)]
    wanted = [line for line in lines if "error" in line.lower() and not line.startswith("ninja: build stopped")]
    line = (causes or wanted or lines or [repr(message)])[0]
    return line if len(line) <= 300 else line[:297] + "..."


def _build() -> None:
    # torch's extension logger warns at import that a CUDA build finds no CUDA runtime, and about compilers it does
    # not know (its format string is broken in some versions); our warning says what failed
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        _compile()
    finally:
        cpp_logger.setLevel(level)


def _compile() -> None:
    from torch.utils import cpp_extension

    _log.info("building the native CPU kernels (once per machine and torch version)")
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the PyPI package (the dev extra) puts it beside Python, maybe off PATH
        try:
            import ninja  # type: ignore[import-not-found]

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            pass  # torch says that ninja is required
    try:
        cpp_extension.load(name=_module_name(), sources=[str(p) for p in SOURCES], is_python_module=False,
                           verbose=False, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"])
    finally:
        os.environ["PATH"] = path
    for op in OPS:
        if not hasattr(torch.ops.mixer_plugins_native, op):
            raise RuntimeError(f"the native library loaded but registered no {op} op")
