"""What our Triton kernel modules share: the guarded ``triton`` import, the matmul precision, ``available``, and the
launch-geometry helpers (one-dimensional grids, 64-bit offsets, the launch device).

Every matmul inside the kernels takes float32 operands and accumulates in float32. Its precision on a GPU is
``MIXER_PLUGINS_TRITON_DOT`` (read at import):

* ``auto`` (default): ``tf32x3`` when the inputs are float32 (about float32 accuracy, on tensor cores), ``bf16``
  when they are bfloat16 or float16 (operands rounded to bfloat16, as mamba-ssm's kernels do: the fastest, and the
  operand tiles take half the shared memory, which the backward kernel needs at state size 128);
* ``ieee``: exact float32 on CUDA cores (several times slower, and its unrolled code compiles 5-10x longer);
* ``tf32x3``, ``tf32`` (~1e-3 relative) or ``bf16`` for every input dtype;
* ``bf16x3``: float32 operands split into bfloat16 high and low parts, three bfloat16 products (about 1e-5
  relative). Half the registers of ``tf32x3``: the MLR attention kernels use it for float32 inputs under ``auto``
  (with ``tf32x3`` they spill registers at sm_90); the scan kernels treat it as ``tf32x3``.

:func:`dot` multiplies operands in their storage dtype (half-precision tiles go to the tensor cores as they are;
float32 ones at the precision above); :func:`mm` takes float32 operands. The Triton interpreter (CPU) computes
``ieee``, ``tf32x3``, ``tf32`` and ``bf16x3`` matmuls in exact float32; ``bf16`` rounds the operands there too.
"""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["DOT_PRECISION_NAME", "IMPORT_ERROR", "INTERPRET", "INTERPRET_AT_IMPORT", "MAX_GRID", "available", "cdiv",
           "dot", "dot_precision", "dot_precision_split", "grid_1d", "mm", "offset64", "on_device", "pow2", "require",
           "rows_last", "tl", "triton"]

try:  # the ``triton`` package
    import triton
    import triton.language as tl
    IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - triton is an optional extra
    triton = None
    tl = None
    IMPORT_ERROR = f"triton is not importable ({exc})"

#: CUDA's limit on the first grid dimension. Our grids are one-dimensional: the second and third dimensions allow only
#: 65,535 programs, which ``batch * heads`` alone passes in a large batch.
MAX_GRID = 2**31 - 1

#: whether ``triton.jit`` defined the kernels for the interpreter (``TRITON_INTERPRET=1`` at import)
INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

DOT_PRECISION_NAME = os.environ.get("MIXER_PLUGINS_TRITON_DOT", "auto")
if DOT_PRECISION_NAME not in ("auto", "ieee", "tf32", "tf32x3", "bf16", "bf16x3"):
    raise ValueError("MIXER_PLUGINS_TRITON_DOT must be auto, ieee, tf32, tf32x3, bf16 or bf16x3, got "
                     f"{DOT_PRECISION_NAME!r}")


def dot_precision(dtype: torch.dtype) -> str:
    """The ``input_precision`` of the kernels' float32 matmuls for inputs of ``dtype`` (see the module docstring)."""
    if DOT_PRECISION_NAME == "bf16x3":
        return "tf32x3"  # (for :func:`mm`; :func:`dot` callers ask :func:`dot_precision_split`)
    if DOT_PRECISION_NAME != "auto":
        return DOT_PRECISION_NAME
    return "tf32x3" if dtype in (torch.float32, torch.float64) else "bf16"


def dot_precision_split(dtype: torch.dtype) -> str:
    """The precision of :func:`dot` for float32 operands of inputs of ``dtype``: as :func:`dot_precision`, except
    ``bf16x3`` in place of ``tf32x3`` under ``auto`` (or when asked for)."""
    if DOT_PRECISION_NAME in ("auto", "bf16x3") and dtype in (torch.float32, torch.float64):
        return "bf16x3"
    return dot_precision(dtype)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-int(a) // int(b))


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def grid_1d(programs: int, what: str) -> tuple[int]:
    """The one-dimensional grid ``(programs,)``, or a clear error when it is past CUDA's limit :data:`MAX_GRID`."""
    if programs > MAX_GRID:
        raise ValueError(f"{what}: {programs} programs are over CUDA's grid limit {MAX_GRID} (reduce the batch)")
    return (max(int(programs), 0),)


def on_device(device: torch.device):
    """The context in which to launch kernels on ``device``'s tensors: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


if triton is not None:
    INTERPRET = tl.constexpr(INTERPRET_AT_IMPORT)

    @triton.jit
    def offset64(index, stride):
        """``index * stride`` in 64 bits: an element offset that stays exact past 2^31 (``index`` may be a scalar or a
        tensor of int32 indices; ``stride`` a runtime integer)."""
        return index.to(tl.int64) * stride

    @triton.jit
    def mm(a, b, DOT: tl.constexpr):
        """``a @ b`` accumulated in float32, at precision ``DOT`` (see the module docstring); the tiles may be float32
        or half precision (kept in their dtype until the product, which saves registers)."""
        if DOT == "bf16":
            if INTERPRET:  # the interpreter multiplies bfloat16 tiles wrongly: round, then multiply in float32
                return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32))
            else:
                return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT)

    @triton.jit
    def dot(a, b, acc, DOT: tl.constexpr):
        """``acc + a @ b`` for operands in their storage dtype, accumulated in float32 ``acc``: bfloat16 and float16
        tiles go to the tensor cores as they are; float32 tiles at precision ``DOT`` (see the module docstring)."""
        if a.dtype == tl.float32:
            if DOT == "bf16x3":  # (a_hi + a_lo)(b_hi + b_lo) without a_lo b_lo, each part bfloat16
                a_hi = a.to(tl.bfloat16)
                b_hi = b.to(tl.bfloat16)
                a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
                b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
                if INTERPRET:  # exact float32, as for tf32x3
                    return tl.dot(a, b, acc)
                else:
                    acc = tl.dot(a_lo, b_hi, acc)
                    acc = tl.dot(a_hi, b_lo, acc)
                    return tl.dot(a_hi, b_hi, acc)
            elif DOT == "bf16":
                if INTERPRET:
                    return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), acc)
                else:
                    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
            else:
                return tl.dot(a, b, acc, input_precision=DOT)
        else:
            if INTERPRET:  # the interpreter multiplies half-precision tiles wrongly: exact products in float32
                return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
            else:
                return tl.dot(a, b, acc)
else:  # pragma: no cover - triton is an optional extra
    INTERPRET = None
    mm = None
    dot = None
    offset64 = None


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


def rows_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride on its last axis (the kernels' loads are vectorized along it): itself when it has."""
    return t if t.stride(-1) == 1 else t.contiguous()


def require(device: torch.device, what: str) -> None:
    """Raise a ``RuntimeError`` naming ``what`` and the reason when the kernels cannot run on ``device``."""
    reason = available(device)
    if reason is not None:
        raise RuntimeError(f"triton {what} unavailable: {reason}")
