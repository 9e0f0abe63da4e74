"""Functional ops beneath the mixers, each with backends behind one dispatcher.

* :func:`ssd` — causal Mamba-2 SSD, with mamba_ssm's ``mamba_chunk_scan_combined`` argument conventions;
* :func:`quasiseparable` — the bidirectional (Hydra) scan: forward + backward + shift + diagonal in one pass;
* :func:`directional_scan` — one direction of either (for the non-additive bidirectional heuristics);
* :func:`scan_matrix` — the materialized matrix of any of them (the oracle, and what ``materialize`` returns);
* :func:`toeplitz_mix` — Toeplitz (long convolution) product by FFT; :func:`toeplitz_matrix` its matrix;
* :func:`depthwise_conv1d` — the blocks' short convolution (optionally with SiLU fused), tiled along time;
* :func:`gated_rmsnorm` — the blocks' output norm, tiled, with a hand-written backward;
* :func:`mlr_attention` — MLR softmax attention (Kuang et al. 2025), tiled by shared level, O(L) memory.

Backends: ``reference`` (materialized, float64-capable), ``torch`` (chunked, O(L) memory; the CPU
default), ``mamba_ssm`` (CUDA, when installed). Pick one with ``backend=...``, :func:`use_backend` or the
``MIXER_PLUGINS_BACKEND`` environment variable.
"""

from . import flop_formulas  # noqa: F401  (FlopCounterMode formulas for CPU attention)
from .conv import depthwise_conv1d
from .dispatch import BACKENDS, BackendUnavailableError, available_backends, resolve_backend, use_backend
from .mlr_attention import mlr_attention
from .norm import gated_rmsnorm
from .scan import directional_scan, prepare_dt, quasiseparable, ssd
from .scan_reference import scan_matrix, scan_reference
from .toeplitz import toeplitz_matrix, toeplitz_mix

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "available_backends",
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
    "mlr_attention",
]
