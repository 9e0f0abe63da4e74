"""Backend selection for the functional ops.

Backends, in the order the automatic choice tries them:

* ``mamba_ssm`` — mamba-ssm's fused Triton SSD kernels (CUDA tensors, package installed; ``ssd`` only);
* ``triton`` — our own Triton kernels (CUDA tensors; on CPU only under ``TRITON_INTERPRET=1`` when asked
  for explicitly);
* ``torch`` — the chunked pure-PyTorch algorithm (any device, O(L) memory): the CPU default;
* ``reference`` — the materialized O(L^2) oracle (any dtype, float64 included). Never chosen automatically.

``backend=None`` means automatic; the ``MIXER_PLUGINS_BACKEND`` environment variable or
:func:`use_backend` override it (under ``torch.compile`` the automatic choice is ``torch``, our custom ops).
Asking for an unavailable backend raises a clear error instead of silently falling back.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator

import torch

from ..errors import BackendUnavailableError, MixerError

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "available_backends",
    "register_backend",
    "resolve_backend",
    "use_backend",
]

BACKENDS = ("reference", "torch", "triton", "mamba_ssm")
_AUTO_ORDER = ("mamba_ssm", "triton", "torch")

# op name -> backend name -> implementation
_IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {}
_local = threading.local()


def register_backend(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the implementation of ``op`` for ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")

    def decorator(fn: Callable) -> Callable:
        _IMPLEMENTATIONS.setdefault(op, {})[backend] = fn
        return fn

    return decorator


def _mamba_ssm_importable() -> tuple[bool, str]:
    if importlib.util.find_spec("mamba_ssm") is None:
        return False, "mamba-ssm is not installed (pip extra 'cuda')"
    if not torch.cuda.is_available():
        return False, "mamba-ssm needs a CUDA device"
    try:  # its package __init__ imports the CUDA extension; import lazily and report why it failed
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return False, f"mamba-ssm failed to import: {type(err).__name__}: {err}"
    return True, ""


def _triton_usable(device: torch.device) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if device.type == "cuda":
        return True, ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU testing)"


def backend_status(op: str, backend: str, device: torch.device) -> tuple[bool, str]:
    """(usable, reason) for ``backend`` running ``op`` on ``device``."""
    impls = _IMPLEMENTATIONS.get(op, {})
    if backend not in BACKENDS:
        return False, f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}"
    if backend not in impls:
        return False, f"op {op!r} has no {backend!r} implementation (it has: {', '.join(sorted(impls))})"
    if backend == "mamba_ssm":
        return _mamba_ssm_importable()
    if backend == "triton":
        return _triton_usable(device)
    return True, ""


def available_backends(op: str, device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run ``op`` on ``device`` right now."""
    device = torch.device(device)
    return [b for b in BACKENDS if backend_status(op, b, device)[0]]


@contextlib.contextmanager
def use_backend(backend: str | None) -> Iterator[None]:
    """Within the block, ops called with ``backend=None`` use ``backend`` (thread-local)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")
    previous = getattr(_local, "backend", None)
    _local.backend = backend
    try:
        yield
    finally:
        _local.backend = previous


def resolve_backend(op: str, backend: str | None, device: torch.device) -> Callable:
    """The implementation of ``op`` to run: the requested backend, or the automatic choice."""
    if torch.compiler.is_compiling():
        # Under torch.compile, run the custom-op ("torch") path unless a backend is named explicitly: it is
        # one opaque op with a fake kernel, and availability probing (imports) cannot be traced.
        chosen = backend or "torch"
        if chosen not in _IMPLEMENTATIONS.get(op, {}):
            raise BackendUnavailableError(f"op {op!r} has no {chosen!r} implementation")
        return _IMPLEMENTATIONS[op][chosen]
    requested = backend or getattr(_local, "backend", None) or os.environ.get("MIXER_PLUGINS_BACKEND") or None
    if requested is not None:
        ok, reason = backend_status(op, requested, device)
        if not ok:
            raise BackendUnavailableError(f"backend {requested!r} cannot run {op!r} on {device}: {reason}")
        return _IMPLEMENTATIONS[op][requested]
    for candidate in _AUTO_ORDER:
        if candidate == "triton" and device.type != "cuda":
            continue  # the interpreter is for tests, never an automatic choice
        if backend_status(op, candidate, device)[0]:
            return _IMPLEMENTATIONS[op][candidate]
    raise BackendUnavailableError(f"no backend can run {op!r} on {device}")  # pragma: no cover
