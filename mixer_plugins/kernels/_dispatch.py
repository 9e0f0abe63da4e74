"""Backend selection for the functional ops: every backend module declares itself, the dispatcher asks them.

An op is a folder, ``kernels/<op>/``, whose ``__init__.py`` holds the public function and ends with
``discover_backends(<op>, __name__)``. Every module of that folder named after a backend in :data:`BACKENDS`
(``reference.py``, ``torch.py``, ``native.py``, ``triton.py``, ``mamba_ssm.py``) is imported then and registers one
:class:`Backend`: its name, its ``impl`` (called with the op's arguments: one typed bundle for the scans, the
convolution and the norm; ``q, k, v`` and keywords for the attention ops), its priority for the
automatic choice and a ``check`` that says why it cannot run here (or ``None`` when it can). Adding a backend
is adding one such module; nothing else names it. A backend module imports its third-party package (mamba-ssm,
Triton) inside its functions, never at the top, so that importing the kernels never imports them.

Choosing, in order:

* ``backend=`` named in the call: that backend, or :class:`BackendUnavailableError` with the reason;
* a preference set by :func:`use_backend` (thread-local) or the ``MIXER_PLUGINS_BACKEND`` environment
  variable: that backend for every op that has one (an op that has none makes its automatic choice);
  :class:`BackendUnavailableError` where the op has it but it cannot run here;
* otherwise the automatic choice: the available backend of highest ``priority`` (``triton`` 40, ``mamba_ssm``
  30, ``native`` 20, ``torch`` 10, so on CUDA: triton, then mamba_ssm, then torch; on CPU: native, then torch;
  ``reference`` has none and is never chosen automatically; the Triton interpreter is for tests and is never
  chosen automatically off CUDA).

Every check looks at the device, the dtypes, the shapes and which options are given, never at tensor values (a
value probe would be a device sync on a GPU). Under ``torch.compile`` and ``torch.export`` the choice is made the
same way while tracing: a compiled model on CUDA runs our Triton custom ops, on CPU the ``torch`` backend (the
``native`` engine runs eagerly only). :func:`backend_report` lists, per op and device, which backends can run and
why not.

ONNX: while ``torch.onnx.export(..., dynamo=True)`` traces, the automatic choice is the ``torch`` backend on every
device, as only its exported form is made of standard ops (ONNX translates no custom op; see ``docs/onnx.md``), or,
for an op of :data:`SYMBOLIC_LENGTH_BACKENDS` traced with a dynamic sequence length, the backend named there; the
TorchScript-based exporter (``dynamo=False``) gets a :class:`BackendUnavailableError` that says to use the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._text import did_you_mean
from ..errors import BackendUnavailableError

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "SYMBOLIC_LENGTH_BACKENDS",
    "Backend",
    "BackendStatus",
    "BackendUnavailableError",
    "available_backends",
    "backend_report",
    "discover_backends",
    "register",
    "registered_ops",
    "resolve_backend",
    "use_backend",
]

BACKENDS = ("reference", "torch", "native", "triton", "mamba_ssm")
"""Every backend name an op may have (a backend module's file name is one of these)."""

ENV_VAR = "MIXER_PLUGINS_BACKEND"

SYMBOLIC_LENGTH_BACKENDS = {"scan": "reference"}
"""Per op, the backend the ONNX exporter traces when a size of the call is a symbol (a dynamic axis, such as the
sequence length) instead of the ``torch`` one, whose graph would hold one size only: the chunked scan loops over its
chunks in Python, so the exporter would fix their number (and with it the length) to the example's. The scan's
``reference`` is its materialized ``L x L`` matrix, standard ops of any length."""

Check = Callable[[torch.device, Any], "str | None"]


def _runs_anywhere(device: torch.device, args: Any) -> str | None:
    return None


@dataclass(frozen=True)
class DtypeArgs:
    """The argument bundle the checks see for an op whose backends take ``q, k, v`` (the attention ops): the
    inputs' dtype (the triton backends refuse float64) and ``row_span``, the largest offset from a batch's base in
    q, k, v or their gradients (:func:`row_span`; 0: not given). A dataclass, so dynamo traces it."""

    dtype: Any
    row_span: int = 0

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> DtypeArgs:
        """The bundle of a call on q, k (b, L, H, e) and v (b, L, H, p), read from shapes and strides only."""
        return cls(q.dtype, row_span=row_span(q, k, v))


def row_span(*tensors: torch.Tensor) -> int:
    """The most elements one (batch)'s slice spans in any of ``tensors`` (b, L, H, width) or in a contiguous
    (b, L, H, width) gradient of each: ``(L-1) s_L + (H-1) s_H + (width-1) s_w + 1``, the largest offset a kernel
    forms from a batch's base (a view of a fused projection has strides above its own shape's)."""
    spans = []
    for t in tensors:
        spans.append(sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:])) + 1)
        spans.append(t.shape[1] * t.shape[2] * t.shape[3])  # its gradient's or output's contiguous buffer
    return max(spans)


@dataclass(frozen=True)
class Backend:
    """One backend of one op, as its module declares it.

    ``impl`` runs the op on the arguments its public function passes. ``priority``: rank in the automatic choice
    (highest first); ``None``: only when asked for by name. ``check(device, args)``: why the backend cannot run on
    ``device`` (``args`` is the call's bundle, or ``None`` when asked without a call), ``None`` when it can.
    ``automatic_devices``: device types on which the automatic choice may pick it (``None``: every type).
    """

    op: str
    name: str
    impl: Callable[..., Any]
    priority: int | None = None
    check: Check = _runs_anywhere
    automatic_devices: tuple[str, ...] | None = None

    def unavailable_reason(self, device: torch.device | str, args: Any = None) -> str | None:
        """Why this backend cannot run here (``None`` when it can)."""
        return self.check(torch.device(device), args)

    def automatic_on(self, device: torch.device) -> bool:
        """Whether the automatic choice may pick this backend for tensors on ``device``."""
        return self.priority is not None and (self.automatic_devices is None or device.type in self.automatic_devices)


@dataclass(frozen=True)
class BackendStatus:
    """One row of :func:`backend_report`."""

    op: str
    backend: str
    device: str
    available: bool
    reason: str          # why it cannot run ("" when it can)
    automatic: bool      # whether the automatic choice may pick it on this device


# op name -> backend name -> backend
_REGISTRY: dict[str, dict[str, Backend]] = {}
_local = threading.local()


def register(backend: Backend) -> Backend:
    """Register ``backend`` (called by each backend module at import); returns it."""
    if backend.name not in BACKENDS:
        raise ValueError(f"unknown backend {backend.name!r}; backends: {', '.join(BACKENDS)}")
    _REGISTRY.setdefault(backend.op, {})[backend.name] = backend
    return backend


def discover_backends(op: str, package: str) -> None:
    """Import the backend modules of ``package`` (its modules named after :data:`BACKENDS`); each registers
    itself. Called once by each op's ``__init__``; an op with no backend module at all is an error."""
    _REGISTRY.setdefault(op, {})
    for name in BACKENDS:
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            importlib.import_module(f"{package}.{name}")
    if not _REGISTRY[op]:
        raise RuntimeError(f"op {op!r} ({package}) has no backend module")


def registered_ops() -> list[str]:
    """The ops that have backends, in registration order."""
    return list(_REGISTRY)


def _unknown(backend: str) -> str:
    return f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)} (backends: {', '.join(BACKENDS)})"


def _check_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise BackendUnavailableError(_unknown(backend))


def _backends_of(op: str) -> dict[str, Backend]:
    if op not in _REGISTRY:
        raise BackendUnavailableError(f"unknown op {op!r}{did_you_mean(op, _REGISTRY)} (ops: {', '.join(_REGISTRY)})")
    return _REGISTRY[op]


def _reason(op: str, backend: str, device: torch.device, args: Any = None) -> str | None:
    """Why ``backend`` cannot run ``op`` on ``device`` (``None`` when it can)."""
    impls = _backends_of(op)
    if backend not in BACKENDS:
        return _unknown(backend)
    if backend not in impls:
        return f"op {op!r} has no {backend!r} implementation (it has: {', '.join(sorted(impls))})"
    return impls[backend].unavailable_reason(device, args)


def available_backends(op: str, device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run ``op`` on ``device`` right now, in :data:`BACKENDS` order."""
    device = torch.device(device)
    return [b for b in BACKENDS if b in _backends_of(op) and _reason(op, b, device) is None]


def backend_report(devices: Iterable[torch.device | str] | None = None) -> list[BackendStatus]:
    """Per op, device and backend name: whether it can run, and why not. ``devices`` defaults to the CPU, plus
    CUDA when a CUDA device is present."""
    if devices is None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for device in (torch.device(d) for d in devices):
        for op, impls in _REGISTRY.items():
            for name in BACKENDS:
                reason = _reason(op, name, device)
                rows.append(BackendStatus(op=op, backend=name, device=str(device), available=reason is None,
                                          reason=reason or "",
                                          automatic=name in impls and impls[name].automatic_on(device)))
    return rows


@contextlib.contextmanager
def use_backend(backend: str | None) -> Iterator[None]:
    """Within the block, ops called with ``backend=None`` use ``backend`` where they have it (thread-local)."""
    if backend is not None:
        _check_name(backend)
    previous = getattr(_local, "backend", None)
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


def _has_symbolic_size(args: Any) -> bool:
    """Whether a tensor of the call's argument bundle (a dataclass) has a size that is a symbol of ``torch.export``
    (a dynamic axis)."""
    if not dataclasses.is_dataclass(args):
        return False
    return any(isinstance(value, torch.Tensor) and any(isinstance(n, torch.SymInt) for n in value.shape)
               for value in (getattr(args, f.name) for f in dataclasses.fields(args)))


def resolve_backend(op: str, backend: str | None, device: torch.device | str, args: Any = None) -> Callable[..., Any]:
    """The implementation of ``op`` to run: ``backend``, the preferred one, or the automatic choice (see the
    module notes). ``args``, the call's argument bundle, lets a backend refuse inputs it cannot handle."""
    impls = _backends_of(op)
    onnx = _onnx_exporter()
    if onnx == "torchscript":
        raise BackendUnavailableError(
            f"op {op!r} cannot be exported by torch.onnx.export(..., dynamo=False), the TorchScript-based exporter; "
            "export with dynamo=True (the default), which traces standard ops only (see docs/onnx.md)")
    device = device if isinstance(device, torch.device) else torch.device(device)
    if backend is None:
        preferred = getattr(_local, "backend", None) or os.environ.get(ENV_VAR) or None
        if preferred is not None:
            _check_name(preferred)
            if preferred in impls:
                backend = preferred
    if backend is not None:
        reason = _reason(op, backend, device, args)
        if reason is not None:
            raise BackendUnavailableError(f"backend {backend!r} cannot run {op!r} on {device}: {reason}")
        return impls[backend].impl
    # automatic_on: the backend has a priority
    candidates = sorted((b for b in impls.values() if b.automatic_on(device)), key=lambda b: -(b.priority or 0))
    if onnx is not None and "torch" in impls:  # only the torch backends export as standard ops
        symbolic = SYMBOLIC_LENGTH_BACKENDS.get(op)
        candidates = [impls[symbolic] if symbolic in impls and _has_symbolic_size(args) else impls["torch"]]
    for candidate in candidates:
        if candidate.unavailable_reason(device, args) is None:
            return candidate.impl
    raise BackendUnavailableError(f"no backend can run {op!r} on {device}")  # pragma: no cover
