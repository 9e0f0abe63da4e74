"""The chunked scan on our native CPU kernel (``kernels/_native/scan.cpp``), where it applies.

The kernel runs the SSD algorithm per (batch, head), chunk by chunk, forward and backward, with every intermediate
in thread-local buffers: the scan allocates its outputs and nothing else (the PyTorch path's autograd graph keeps
dozens of chunk-sized tensors per call). It applies to eager CPU calls in float32 or float64 (every input of one
dtype) without ``seq_idx``, where every step size is >= 0, every ``A`` <= 0 (so that every exponent it takes is
<= 0) and every input is finite (a non-finite token must not reach tokens it cannot see: the PyTorch path selects
those away). Elsewhere the PyTorch path runs.

**Opt-in** (``USE_NATIVE = True``): it equals the reference to float64 rounding, values and every gradient, and it
allocates nothing per chunk (no page faults at L = 1024, where the PyTorch path takes 5-9k per call), but on the
2-core development machine it is not faster than the PyTorch path's factored decays: it runs one small product per
(head, chunk) where that path runs each group's heads, and all chunks, in a few large batched products (quasi at
L = 16384: 8.9 against 10.7 x attention's time; L = 1024 and the ViT step: within the noise). See
docs/performance.md ("What changed in session 8") for the measurements and the next steps.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _native
from .._threads import threads_for
from .chunked import _known_finite, chunk_length
from .inputs import ScanInputs

__all__ = ["USE_NATIVE", "applies", "run_native"]

#: run the native kernel where it applies (opt-in, see the module notes); False (the default): the PyTorch path
USE_NATIVE = False


def _chunk(inputs: ScanInputs) -> int:
    d = inputs.forward or inputs.backward
    b, length, heads, head_dim = inputs.x.shape
    groups, state = d.B.shape[2:]
    directions = (inputs.forward is not None) + (inputs.backward is not None)
    return chunk_length(length, inputs.chunk_size, heads, head_dim, groups, state, directions)


def applies(inputs: ScanInputs) -> bool:
    """Whether :func:`run_native` takes ``inputs`` (and the kernel is built: the first such call builds it)."""
    x = inputs.x
    if not USE_NATIVE or torch.compiler.is_compiling() or x.device.type != "cpu" or inputs.seq_idx is not None:
        return False
    if x.dtype not in (torch.float32, torch.float64) or x.numel() == 0:
        return False
    dirs = [d for d in (inputs.forward, inputs.backward) if d is not None]
    tensors = [x] + [t for d in dirs for t in (d.dt, d.A, d.B, d.C)]
    tensors += [t for t in (inputs.diag, inputs.initial_state) if t is not None]
    if not dirs or any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        return False
    if not _known_finite(*tensors):
        return False
    if any(bool((d.A > 0).any()) or bool((d.dt < 0).any()) for d in dirs):
        return False
    return _native.load()


def _direction_args(inputs: ScanInputs) -> list[Tensor | None]:
    args: list[Tensor | None] = []
    for d in (inputs.forward, inputs.backward):
        args += [None] * 4 if d is None else [d.dt.contiguous(), d.A.contiguous(), d.B.contiguous(),
                                               d.C.contiguous()]
    return args


class _NativeScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shift: bool, chunk: int, want_final: bool, x: Tensor, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b,
                C_b, diag: Tensor | None, init: Tensor | None):
        x = x.contiguous()
        init = None if init is None else init.contiguous()
        ctx.elements = x.numel() * chunk  # the scan's work, as the PyTorch path sizes its threads
        with threads_for(ctx.elements, x.device):
            y, final = torch.ops.mixer_plugins_native.scan_forward(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b,
                                                                  init, shift, chunk, want_final)
        if diag is not None:
            y.addcmul_(x, diag[..., None])
        ctx.save_for_backward(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init)
        ctx.shift, ctx.chunk = shift, chunk
        return y, final

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor | None, dfinal: Tensor | None):
        x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init = ctx.saved_tensors
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        if dfinal is not None and dfinal.numel() == 0:
            dfinal = None
        with threads_for(ctx.elements, x.device):
            out = torch.ops.mixer_plugins_native.scan_backward(dy, None if dfinal is None else dfinal.contiguous(),
                                                               x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, init,
                                                               ctx.shift, ctx.chunk)
        dx = out[0]
        grads: list[Tensor | None] = []
        for base, (dt, Bm) in zip((1, 5), ((dt_f, B_f), (dt_b, B_b))):
            if dt is None:
                grads += [None] * 4
                continue
            grads += [out[base], out[base + 1].sum(0), _per_group(out[base + 2], Bm), _per_group(out[base + 3], Bm)]
        ddiag = None
        if diag is not None:
            dx.addcmul_(dy, diag[..., None])
            ddiag = (dy * x).sum(-1)
        dinit = out[9] if init is not None else None
        return (None, None, None, dx, *grads, ddiag, dinit)


def _per_group(per_head: Tensor, like: Tensor) -> Tensor:
    """(b, l, h, n) gradients of each head's copy of B or C -> (b, l, g, n): summed over each group's heads."""
    b, length, groups, state = like.shape
    return per_head.view(b, length, groups, per_head.shape[2] // groups, state).sum(3)


def run_native(inputs: ScanInputs, *, want_final: bool) -> tuple[Tensor, Tensor | None]:
    """The scan of ``inputs`` on the native kernel (see :func:`applies`): (y, the forward direction's final state
    when ``want_final``, else None). Differentiable once."""
    y, final = _NativeScan.apply(inputs.shift, _chunk(inputs), want_final, inputs.x, *_direction_args(inputs),
                                 inputs.diag, inputs.initial_state)
    return y, (final if want_final else None)
