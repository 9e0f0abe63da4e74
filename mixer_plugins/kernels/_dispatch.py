"""What every op's choice of backend shares: the preference (``backend=``, :func:`use_backend`, the
``MIXER_PLUGINS_BACKEND`` environment variable), the ONNX rules and :func:`backend_report`.

Each op names its own backends in its ``__init__.py``: an :class:`Op` with the forms it has, its automatic order
per device type and a ``why_not(backend, device, **call)`` function that says why a form cannot run a call (``None``
when it can), then an ``if`` over the chosen name that calls that form. :meth:`Op.choose` picks the name, in order:

* ``backend=`` named in the call: that backend, or :class:`BackendUnavailableError` with the reason;
* a preference set by :func:`use_backend` (thread-local) or the ``MIXER_PLUGINS_BACKEND`` environment
  variable: that backend for every op that has one (an op that has none makes its automatic choice);
  :class:`BackendUnavailableError` where the op has it but it cannot run here;
* otherwise the automatic choice: the first backend of the op's order for the device type that can run the call
  (on CUDA: triton, then mamba_ssm, then torch; on CPU: native, then torch; elsewhere torch). ``reference`` is never
  chosen automatically, nor is the Triton interpreter off CUDA.

Every check looks at the device, the dtypes, the shapes and which options are given, never at tensor values (a
value probe would be a device sync on a GPU). Under ``torch.compile`` and ``torch.export`` the choice is made the
same way while tracing: a compiled model on CUDA runs our Triton custom ops, on CPU the ``torch`` backend (the
``native`` kernels run eagerly only).

ONNX: while ``torch.onnx.export(..., dynamo=True)`` traces, the automatic choice is the ``torch`` backend on every
device, as only its exported form is made of standard ops (ONNX translates no custom op; see ``docs/onnx.md``), or,
for an op with a ``symbolic_length`` backend traced with a dynamic size (such as the sequence length), that backend;
the TorchScript-based exporter (``dynamo=False``) gets a :class:`BackendUnavailableError` that says to use the other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._text import did_you_mean
from ..errors import BackendUnavailableError

__all__ = ["BACKENDS", "ENV_VAR", "BackendStatus", "BackendUnavailableError", "Op", "available_backends",
           "backend_report", "resolve_backend", "row_span", "use_backend"]

BACKENDS = ("reference", "torch", "native", "triton", "mamba_ssm")
"""Every backend name an op may have."""

ENV_VAR = "MIXER_PLUGINS_BACKEND"

#: the automatic order on a device type an op does not name
_ELSEWHERE = ("torch",)

class _Preference(threading.local):
    """The backend :func:`use_backend` prefers, per thread (set on the instance, which ``torch.compile`` reads while
    tracing; a class default would be read in its place)."""

    def __init__(self) -> None:
        self.backend: str | None = None


_local = _Preference()


@dataclass(frozen=True)
class Op:
    """One op's backends, as its ``__init__.py`` names them.

    ``backends``: the forms it has; ``automatic``: per device type, the order of the automatic choice (other device
    types: ``torch``); ``why_not(backend, device, **call)``: why ``backend`` cannot run the call described by the
    keywords (none given: any call on ``device``), ``None`` when it can. ``symbolic_length``: the backend the ONNX
    exporter traces when a tensor of the call has a symbolic size, in place of ``torch``.
    """

    name: str
    backends: tuple[str, ...]
    automatic: dict[str, tuple[str, ...]]
    why_not: Callable[..., str | None]
    symbolic_length: str | None = None

    def __post_init__(self) -> None:
        OPS[self.name] = self

    def reason(self, backend: str, device: torch.device, **call: Any) -> str | None:
        """Why ``backend`` cannot run this op's call on ``device`` (``None`` when it can)."""
        if backend not in BACKENDS:
            return _unknown(backend)
        if backend not in self.backends:
            return f"op {self.name!r} has no {backend!r} implementation (it has: {', '.join(sorted(self.backends))})"
        return self.why_not(backend, device, **call)

    def choose(self, backend: str | None, device: torch.device, **call: Any) -> str:
        """The backend that runs the call: ``backend``, the preferred one, or the automatic choice (see the module
        notes); ``call`` is what ``why_not`` reads."""
        onnx = _onnx_exporter()
        if onnx == "torchscript":
            raise BackendUnavailableError(
                f"op {self.name!r} cannot be exported by torch.onnx.export(..., dynamo=False), the TorchScript-based "
                "exporter; export with dynamo=True (the default), which traces standard ops only (see docs/onnx.md)")
        if backend is None:
            preferred = _local.backend or os.environ.get(ENV_VAR) or None
            if preferred is not None:
                _check_name(preferred)
                if preferred in self.backends:
                    backend = preferred
        if backend is not None:
            reason = self.reason(backend, device, **call)
            if reason is not None:
                raise BackendUnavailableError(f"backend {backend!r} cannot run {self.name!r} on {device}: {reason}")
            return backend
        if onnx is not None:  # only the torch backends export as standard ops
            if self.symbolic_length is not None and _has_symbolic_size(call.values()):
                return self.symbolic_length
            return "torch"
        for name in self.automatic.get(device.type, _ELSEWHERE):
            if self.why_not(name, device, **call) is None:
                return name
        raise BackendUnavailableError(f"no backend can run {self.name!r} on {device}")  # pragma: no cover


#: every op, by name, in the order their modules are imported
OPS: dict[str, Op] = {}


@dataclass(frozen=True)
class BackendStatus:
    """One row of :func:`backend_report`."""

    op: str
    backend: str
    device: str
    available: bool
    reason: str          # why it cannot run ("" when it can)
    automatic: bool      # whether the automatic choice may pick it on this device


def _unknown(backend: str) -> str:
    return f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)} (backends: {', '.join(BACKENDS)})"


def _check_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise BackendUnavailableError(_unknown(backend))


def _op(op: str) -> Op:
    if op not in OPS:
        raise BackendUnavailableError(f"unknown op {op!r}{did_you_mean(op, OPS)} (ops: {', '.join(OPS)})")
    return OPS[op]


def resolve_backend(op: str, backend: str | None, device: torch.device | str, **call: Any) -> str:
    """The name of the backend ``op`` runs for a call on ``device`` (described by ``call``, the keywords of its
    ``why_not``), as its public function chooses it."""
    return _op(op).choose(backend, torch.device(device), **call)


def available_backends(op: str, device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run ``op`` on ``device`` right now, in :data:`BACKENDS` order."""
    found, device = _op(op), torch.device(device)
    return [b for b in BACKENDS if b in found.backends and found.why_not(b, device) is None]


def backend_report(devices: Iterable[torch.device | str] | None = None) -> list[BackendStatus]:
    """Per op, device and backend name: whether it can run, and why not. ``devices`` defaults to the CPU, plus
    CUDA when a CUDA device is present."""
    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for device in (torch.device(d) for d in devices):
        for op in OPS.values():
            order = op.automatic.get(device.type, _ELSEWHERE)
            for name in BACKENDS:
                reason = op.reason(name, device)
                rows.append(BackendStatus(op=op.name, backend=name, device=str(device), available=reason is None,
                                          reason=reason or "", automatic=name in order))
    return rows


@contextlib.contextmanager
def use_backend(backend: str | None) -> Iterator[None]:
    """Within the block, ops called with ``backend=None`` use ``backend`` where they have it (thread-local)."""
    if backend is not None:
        _check_name(backend)
    previous = _local.backend
    _local.backend = backend
    try:
        yield
    finally:
        _local.backend = previous


def _onnx_exporter() -> str | None:
    """Which ONNX exporter is tracing this call: ``"dynamo"`` (``torch.onnx.export(..., dynamo=True)``, which runs
    ``torch.export``), ``"torchscript"`` (``dynamo=False``) or ``None``. Under ``torch.compile`` always ``None``."""
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        return None
    # neither exporter traces (the TorchScript one traces with torch.jit, the dynamo one exports); is_tracing is
    # public, though torch.jit does not list it
    if not (torch.jit.is_tracing() or torch.compiler.is_exporting()):  # type: ignore[attr-defined]
        return None
    if "torch.onnx" not in sys.modules or not torch.onnx.is_in_onnx_export():
        return None
    return "dynamo" if torch.compiler.is_exporting() else "torchscript"


def _has_symbolic_size(values: Iterable[Any]) -> bool:
    """Whether a tensor among ``values`` has a size that is a symbol of ``torch.export`` (a dynamic axis)."""
    return any(isinstance(v, torch.Tensor) and any(isinstance(n, torch.SymInt) for n in v.shape) for v in values)


def row_span(*tensors: torch.Tensor) -> int:
    """The most elements one (batch)'s slice spans in any of ``tensors`` (b, L, H, width) or in a contiguous
    (b, L, H, width) gradient of each: ``(L-1) s_L + (H-1) s_H + (width-1) s_w + 1``, the largest offset a kernel
    forms from a batch's base (a view of a fused projection has strides above its own shape's)."""
    spans = []
    for t in tensors:
        spans.append(sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:])) + 1)
        spans.append(t.shape[1] * t.shape[2] * t.shape[3])  # its gradient's or output's contiguous buffer
    return max(spans)
