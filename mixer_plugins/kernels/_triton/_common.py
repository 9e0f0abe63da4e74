"""What our Triton kernel modules share: the guarded ``triton`` import, the matmul precision and ``available``.

``MIXER_PLUGINS_TRITON_DOT`` sets the precision of the kernels' float32 matmuls, fixed at import: ``ieee``
(default: exact float32, the tested semantics; on GPUs it runs on CUDA cores, not tensor cores), ``tf32x3`` (about
float32 accuracy on tensor cores) or ``tf32`` (fastest, ~1e-3 relative).
"""

from __future__ import annotations

import os

import torch

try:  # the ``triton`` package
    import triton
    import triton.language as tl
    IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - triton is an optional extra
    triton = None
    tl = None
    IMPORT_ERROR = f"triton is not importable ({exc})"

#: whether ``triton.jit`` defined the kernels for the interpreter (``TRITON_INTERPRET=1`` at import)
INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

DOT_PRECISION_NAME = os.environ.get("MIXER_PLUGINS_TRITON_DOT", "ieee")
if DOT_PRECISION_NAME not in ("ieee", "tf32", "tf32x3"):
    raise ValueError(f"MIXER_PLUGINS_TRITON_DOT must be ieee, tf32 or tf32x3, got {DOT_PRECISION_NAME!r}")
DOT_PRECISION = tl.constexpr(DOT_PRECISION_NAME) if tl is not None else None


def available(device: torch.device | str | None = None) -> str | None:
    """Why our Triton kernels cannot run on ``device`` (default: CUDA if present, else CPU), or None if they can."""
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if INTERPRET_AT_IMPORT:
        if dev.type != "cpu":
            return "TRITON_INTERPRET=1 was set when the kernels were defined: they run on CPU tensors only"
        return None
    if dev.type != "cuda" or not torch.cuda.is_available():
        return ("the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before mixer_plugins.kernels._triton "
                "is imported, to run them on CPU)")
    return None
