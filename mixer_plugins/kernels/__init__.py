"""Functional ops beneath the mixers, one folder per op, each with backends behind one dispatcher.

* :func:`ssd` — causal Mamba-2 SSD, with mamba_ssm's ``mamba_chunk_scan_combined`` argument conventions;
* :func:`quasiseparable` — the bidirectional (Hydra) scan: forward + backward + shift + diagonal in one pass;
* :func:`directional_scan` — one direction of either (for the non-additive bidirectional heuristics);
* :func:`scan_matrix` — the materialized matrix of any of them (the oracle, and what ``materialize`` returns);
* :func:`toeplitz_mix` — Toeplitz (long convolution) product by FFT; :func:`toeplitz_matrix` its matrix;
* :func:`depthwise_conv1d` — the blocks' short convolution (optionally with SiLU fused), tiled along time;
* :func:`gated_rmsnorm` — the blocks' output norm, tiled, with a hand-written backward;
* :func:`ssd_decode_step` — one decoding step of an SSD-style block (short convolution and state update, fused);
* :func:`mlr_attention` — MLR softmax attention (Kuang et al. 2025), tiled by shared level, O(L) memory;
* :func:`local_attention` — sliding-window softmax attention (+ optional global tokens), blocked, O(L * window);
  on CUDA the MLR Triton kernel with the tiles outside the band skipped.

Layout: ``kernels/<op>/__init__.py`` holds the public function(s), the argument checks and, in plain sight, the
choice of form: an :class:`~._dispatch.Op` naming the forms, their automatic order per device type and why each
cannot run a call, then an ``if`` over the chosen name that calls the form. Each form is a module beside it
(``reference.py``, ``torch.py`` or ``chunked.py``, ``native.py``, ``triton_kernels.py``, ``mamba_ssm.py``). The
three scans are one op, ``scan``, in :mod:`.scan`.

Backends: ``reference`` (materialized, float64-capable; the oracle), ``torch`` (plain PyTorch, O(L) memory; any
device), ``native`` (our C++ CPU engine; the CPU default where it applies), ``triton`` (our kernels; the CUDA
default), ``mamba_ssm`` (CUDA, when installed). Pick one with ``backend=...``, :func:`use_backend` or the
``MIXER_PLUGINS_BACKEND`` environment variable; :func:`backend_report` says which can run here and why not.
"""

from . import flop_formulas  # noqa: F401  (FlopCounterMode formulas for CPU attention)
from ._dispatch import (
    BACKENDS,
    BackendStatus,
    BackendUnavailableError,
    available_backends,
    backend_report,
    resolve_backend,
    use_backend,
)
from .conv import depthwise_conv1d, depthwise_conv1d_flops
from .decode import ssd_decode_step
from .local_attention import LocalPlan, local_attention, local_attention_flops
from .mlr_attention import mlr_attention, mlr_attention_flops
from .norm import gated_rmsnorm
from .scan import (
    chunked_scan_flops,
    directional_scan,
    prepare_dt,
    quasiseparable,
    scan_matrix,
    scan_reference,
    ssd,
)
from .toeplitz import toeplitz_causal_flops, toeplitz_fft_flops, toeplitz_matrix, toeplitz_mix

__all__ = [
    "BACKENDS",
    "BackendStatus",
    "BackendUnavailableError",
    "available_backends",
    "backend_report",
    "resolve_backend",
    "use_backend",
    "ssd",
    "quasiseparable",
    "directional_scan",
    "prepare_dt",
    "scan_matrix",
    "scan_reference",
    "toeplitz_matrix",
    "toeplitz_mix",
    "depthwise_conv1d",
    "gated_rmsnorm",
    "ssd_decode_step",
    "chunked_scan_flops",
    "toeplitz_fft_flops",
    "toeplitz_causal_flops",
    "depthwise_conv1d_flops",
    "mlr_attention",
    "mlr_attention_flops",
    "LocalPlan",
    "local_attention",
    "local_attention_flops",
]
