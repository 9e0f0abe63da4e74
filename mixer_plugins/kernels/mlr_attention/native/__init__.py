"""The fused CPU engine of the tiled MLR op (``engine="native"``): a C++ kernel, ``mlr_cpu.cpp`` beside this file,
compiled on first use.

One pass over the (query tile, key range) pieces that share a level, each piece's scores from one BLAS product at
its own width ``r_0 + ... + r_m`` (no zero padding, unlike the ``flash`` engine; no Python per task, unlike the
``matmul`` engine), a vectorized ``exp`` and an online softmax; the backward recomputes the scores from the row
log-sum-exp (flash attention's split-KV backward). Memory is linear in the length; float32 and float64.

**Build.** :func:`load` compiles the kernel with :func:`torch.utils.cpp_extension.load` (a C++17 compiler with
OpenMP and ``ninja`` are needed; about 10 s, once per machine and torch version: the result is cached in torch's
extension folder, ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). The products call the BLAS that
``libtorch_cpu`` exports (``sgemm_``/``dgemm_``: MKL in the x86 wheels). If the build or the load fails, one
``RuntimeWarning`` says why and ``engine="auto"`` uses the next engine (``flash``); ``engine="native"`` then
raises. ``MIXER_PLUGINS_NATIVE=0`` in the environment never builds it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

__all__ = ["ENV_VAR", "TILES", "backward", "forward", "is_loaded", "load", "unavailable_reason"]

#: set to ``0`` (or ``false``/``no``/``off``) to never build the kernel
ENV_VAR = "MIXER_PLUGINS_NATIVE"
#: (query rows, keys) per tile of the forward and of the backward (measured at L = 4096 on 2 cores: 256 x 512 and
#: 128 x 256 within 2% of the best; the score tile stays in the L2 cache)
TILES = {"forward": (256, 512), "backward": (128, 256)}

_SOURCE = Path(__file__).with_name("mlr_cpu.cpp")
_LOCK = threading.Lock()
_STATE: dict[str, Optional[str] | bool] = {"tried": False, "error": None}
_log = logging.getLogger(__name__)


def _disabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")


def _module_name() -> str:
    """One build per torch version and CPU capability (the kernel is compiled for the machine's vector unit)."""
    tag = f"{torch.__version__}_{torch.backends.cpu.get_cpu_capability()}"
    return "mixer_plugins_mlr_cpu_" + re.sub(r"[^0-9A-Za-z]+", "_", tag).lower()


def is_loaded() -> bool:
    """Whether the kernel is built and registered in this process (never builds; safe under ``torch.compile``)."""
    return bool(_STATE["tried"]) and _STATE["error"] is None


def unavailable_reason() -> Optional[str]:
    """Why :func:`load` failed (None if it succeeded or was not tried)."""
    return _STATE["error"]  # type: ignore[return-value]


def load() -> bool:
    """Build (once per machine) and load the kernel; True when ``torch.ops.mixer_plugins_native`` is ready.

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
                warnings.warn(f"mixer_plugins: the fused CPU MLR attention kernel could not be built or loaded "
                              f"({error}); MLR attention on CPU uses the slower 'flash' engine. It needs a C++17 "
                              f"compiler with OpenMP and ninja; set {ENV_VAR}=0 to skip the build.",
                              RuntimeWarning, stacklevel=3)
        _STATE["error"] = error
        _STATE["tried"] = True
        return error is None


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

    _log.info("building the fused CPU MLR attention kernel (once per machine and torch version)")
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the PyPI package (the dev extra) puts it beside Python, maybe off PATH
        try:
            import ninja  # type: ignore[import-not-found]

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            pass  # torch says that ninja is required
    try:
        cpp_extension.load(name=_module_name(), sources=[str(_SOURCE)], is_python_module=False, verbose=False,
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    finally:
        os.environ["PATH"] = path
    if not hasattr(torch.ops.mixer_plugins_native, "mlr_forward"):
        raise RuntimeError("the kernel library loaded but registered no mlr_forward op")


def _levels(ranks: Sequence[int], block_divide: bool) -> tuple[list[int], list[float]]:
    """Per level ``m``: the score width of the pairs sharing levels ``0..m``, and their divisor's inverse."""
    widths, total = [], 0
    for r in ranks:
        total += int(r)
        widths.append(total)
    return widths, [1.0 / (m + 1) if block_divide else 1.0 for m in range(len(ranks))]


def _ready() -> None:
    if not load():
        raise RuntimeError(f"the native MLR engine is unavailable: {unavailable_reason()}")


def forward(q: Tensor, k: Tensor, v: Tensor, key_len: Optional[Tensor], ranks: Sequence[int],
            block_sizes: Sequence[int], causal: bool, block_divide: bool) -> tuple[Tensor, Tensor]:
    """Output (B, L, H, P) and row log-sum-exp (B, L, H) of MLR attention on prepared inputs: q, k (B, L, H, D) with
    the level scales applied, v (B, L, H, P), float32 or float64 CPU tensors; ``key_len`` int64 (B,) (keys at and
    beyond it are excluded; None: none); ``block_sizes`` with 0 for a global level."""
    _ready()
    widths, scales = _levels(ranks, block_divide)
    tq, tk = TILES["forward"]
    return torch.ops.mixer_plugins_native.mlr_forward(q.contiguous(), k.contiguous(), v.contiguous(), key_len,
                                                      widths, [int(s) for s in block_sizes], scales, causal, tq, tk)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_len: Optional[Tensor],
             ranks: Sequence[int], block_sizes: Sequence[int], causal: bool,
             block_divide: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of :func:`forward` given its output and log-sum-exp."""
    _ready()
    widths, scales = _levels(ranks, block_divide)
    tq, tk = TILES["backward"]
    return torch.ops.mixer_plugins_native.mlr_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
        key_len, widths, [int(s) for s in block_sizes], scales, causal, tq, tk)
