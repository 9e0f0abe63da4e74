"""The chunked scan on our native CPU kernel (``kernels/_native/scan.cpp``), where it applies.

The kernel runs the scan with **factored decays**, as :mod:`.factored` does in PyTorch: per chunk and group, one
product ``mask(C~ B^T) [v X]`` over all of the group's heads, the chunk states ``B^T [v X]``, a short sequential
pass over the scaled states ``K_c = e^{m_c} H_c`` per head, and the read-out ``C~ K_c``, each phase parallel over
(batch, group, chunk) or (batch, head); and a written-out backward in the same three phases. Its intermediates live
in a workspace the calling thread keeps and reuses, so a call allocates its outputs and nothing else: no page
faults (the PyTorch path's autograd graph took 5-9k per call at L = 1024). Where a chunk's decay range is too wide
for the factors (:data:`.factored.MAX_HALF_RANGE`), or with :data:`FACTORED` False, it runs one product per (head,
chunk) with the exact decays instead. The kernel skips what is zero: the upper triangles of the masked
intra-chunk matrices (in row blocks), the entering state's products of the first chunk without an initial state, and
the last chunk's state without a final state; so a short sequence (:data:`ONE_CHUNK_STATES`) runs as one chunk,
with no state work at all (a ViT's 197 tokens).

It applies to eager CPU calls in float32 or float64 (every input of one dtype) without ``seq_idx``, of at most
:data:`MAX_CHUNKS` chunks, where every step size is >= 0, every ``A`` <= 0 (every exponent the exact form takes is
<= 0) and every input is finite (a non-finite token must not reach tokens it cannot see: the PyTorch path selects
those away). Elsewhere, or with :data:`USE_NATIVE` False (or ``MIXER_PLUGINS_NATIVE=0``), the PyTorch path runs.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _native
from .._threads import threads_for
from .chunked import _known_finite, chunk_length
from .factored import MAX_HALF_RANGE
from .inputs import ScanInputs

__all__ = ["FACTORED", "MAX_CHUNKS", "ONE_CHUNK_STATES", "USE_NATIVE", "applies", "run_native"]

#: run the native kernel where it applies; False: the PyTorch path only
USE_NATIVE = True
#: with factored decays (one product per group and chunk) where every chunk's decay range allows it, as
#: :mod:`.factored`; else (and with False) one product per head and chunk
FACTORED = True
#: a sequence of at most ``chunk_size + ONE_CHUNK_STATES * state`` tokens runs as **one chunk** with factored
#: decays, where its whole decay range allows it (0: never). Per token, chunks of Q tokens cost about
#: ``(2 Q + 8 N) R`` multiply-adds forward+backward (the masked intra-chunk products, half of each skipped by the
#: kernel's triangular row blocks, and six state products of N x R), one chunk of L tokens ``2 L R``, with no state
#: work at all: the two meet at L = Q + 4 N. Measured (quasiseparable scan, 12 heads of 64, state 64, fwd+bwd, 2
#: threads): 197 tokens x 32 as one chunk 85-88 ms against 114-133 ms in chunks of 50; 256 tokens 117 vs 145 ms;
#: 384 tokens 268 vs 245 ms.
ONE_CHUNK_STATES = 4
#: sequences of more chunks than this take the PyTorch path (quasiseparable fwd+bwd, separate processes: the
#: kernel took 33 vs 38.5 ms at L = 1024 (16 chunks), 124-129 vs 156-157 ms at 4096, 279 vs 311 ms at 8192 (128
#: chunks), but 665-674 vs 617-638 ms at 16384 (256 chunks). Session 9, with the row blocks and the output pool: the
#: scan alone at 16384 250 vs 228-257 ms, no clear win. Its time per token is flat (1 x 8192: 127 ms; 2 x 8192:
#: 237; 1 x 16384: 244; 4 x 4096: 234), the PyTorch path's falls with length (its batched products grow), and
#: they meet near 256 chunks; the kernel runs at about 85 GFLOP/s there, 80% of its FLOPs in the state products)
MAX_CHUNKS = 128


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
    dirs = [d for d in (inputs.forward, inputs.backward) if d is not None]
    if not dirs or x.numel() == 0 or -(-x.shape[1] // _chunk(inputs)) > MAX_CHUNKS:
        return False
    tensors = [x] + [t for d in dirs for t in (d.dt, d.A, d.B, d.C)]
    tensors += [t for t in (inputs.diag, inputs.initial_state) if t is not None]
    if x.dtype not in (torch.float32, torch.float64) or any(t.dtype != x.dtype for t in tensors):
        return False  # (checked before the value passes below; _native.takes checks it again, cheaply)
    if not _known_finite(*tensors) or any(bool((d.A > 0).any()) or bool((d.dt < 0).any()) for d in dirs):
        return False
    return _native.takes(*tensors)


def _direction_args(inputs: ScanInputs) -> list[Tensor | None]:
    args: list[Tensor | None] = []
    for d in (inputs.forward, inputs.backward):
        args += [None] * 4 if d is None else [d.dt.contiguous(), d.A.contiguous(), d.B.contiguous(),
                                               d.C.contiguous()]
    return args


def _factored_fits(inputs: ScanInputs, chunk: int) -> bool:
    """Whether every chunk's half decay ``|p_last| / 2`` stays within :data:`.factored.MAX_HALF_RANGE` (in each
    direction's own chunking: the backward direction's chunks are cut from the end)."""
    limit = MAX_HALF_RANGE.get(inputs.x.dtype)
    if limit is None:
        return False
    for d, reverse in ((inputs.forward, False), (inputs.backward, True)):
        if d is None:
            continue
        a = d.dt * d.A
        if reverse:
            a = a.flip(1)
        pad = (-a.shape[1]) % chunk
        if pad:
            a = torch.nn.functional.pad(a, (0, 0, 0, pad))
        totals = a.unflatten(1, (a.shape[1] // chunk, chunk)).sum(2)
        if bool(totals.abs().amax() > 2 * limit):
            return False
    return True


class _NativeScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shift: bool, chunk: int, want_final: bool, factored: bool, x: Tensor, dt_f, A_f, B_f, C_f,
                dt_b, A_b, B_b, C_b, diag: Tensor | None, init: Tensor | None):
        x = x.contiguous()
        init = None if init is None else init.contiguous()
        ctx.elements = x.numel() * chunk  # the scan's work, as the PyTorch path sizes its threads
        op = torch.ops.mixer_plugins_native.scan_factored_forward if factored else \
            torch.ops.mixer_plugins_native.scan_forward
        with threads_for(ctx.elements, x.device):
            y, final = op(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, init, shift, chunk, want_final)
        if diag is not None:
            y.addcmul_(x, diag[..., None])
        ctx.save_for_backward(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init)
        ctx.shift, ctx.chunk, ctx.factored = shift, chunk, factored
        return y, final

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor | None, dfinal: Tensor | None):
        x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init = ctx.saved_tensors
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        if dfinal is not None and dfinal.numel() == 0:
            dfinal = None
        op = torch.ops.mixer_plugins_native.scan_factored_backward if ctx.factored else \
            torch.ops.mixer_plugins_native.scan_backward
        with threads_for(ctx.elements, x.device):
            out = op(dy, None if dfinal is None else dfinal.contiguous(), x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b,
                     init, ctx.shift, ctx.chunk)
        dx = out[0]
        grads: list[Tensor | None] = []
        for base, (dt, Bm), reverse in zip((1, 5), ((dt_f, B_f), (dt_b, B_b)), (False, True)):
            if dt is None:
                grads += [None] * 4
            elif ctx.factored:  # dA per chunk, dB and dC~ per group: C~ is C one row back in the direction
                grads += [out[base], out[base + 1].sum((0, 1)), out[base + 2],
                          _unshift(out[base + 3], ctx.shift, reverse)]
            else:
                grads += [out[base], out[base + 1].sum(0), _per_group(out[base + 2], Bm),
                          _per_group(out[base + 3], Bm)]
        ddiag = None
        if diag is not None:
            dx.addcmul_(dy, diag[..., None])
            ddiag = (dy * x).sum(-1)
        dinit = out[9] if init is not None else None
        return (None, None, None, None, dx, *grads, ddiag, dinit)


def _unshift(grad_shifted: Tensor, shift: bool, reverse: bool) -> Tensor:
    """The gradient of C from that of C~ (C~_t = C_{t-1}, or C_{t+1} for the backward direction, with shift)."""
    if not shift:
        return grad_shifted
    grad = torch.zeros_like(grad_shifted)
    if reverse:
        grad[:, 1:] = grad_shifted[:, :-1]
    else:
        grad[:, :-1] = grad_shifted[:, 1:]
    return grad


def _per_group(per_head: Tensor, like: Tensor) -> Tensor:
    """(b, l, h, n) gradients of each head's copy of B or C -> (b, l, g, n): summed over each group's heads."""
    b, length, groups, state = like.shape
    return per_head.view(b, length, groups, per_head.shape[2] // groups, state).sum(3)


def _chunk_and_form(inputs: ScanInputs) -> tuple[int, bool]:
    """The kernel's chunk length and whether it runs with factored decays: one chunk for a short enough sequence
    (:data:`ONE_CHUNK_STATES`) whose whole decay range fits the factors, else the chunked scan's own chunks,
    factored where every chunk's range fits."""
    chunk = _chunk(inputs)
    length = inputs.x.shape[1]
    state = (inputs.forward or inputs.backward).B.shape[-1]
    if FACTORED and chunk < length <= inputs.chunk_size + ONE_CHUNK_STATES * state and _factored_fits(inputs, length):
        return length, True
    return chunk, FACTORED and _factored_fits(inputs, chunk)


def run_native(inputs: ScanInputs, *, want_final: bool) -> tuple[Tensor, Tensor | None]:
    """The scan of ``inputs`` on the native kernel (see :func:`applies`): (y, the forward direction's final state
    when ``want_final``, else None). Differentiable once."""
    chunk, factored = _chunk_and_form(inputs)
    y, final = _NativeScan.apply(inputs.shift, chunk, want_final, factored, inputs.x, *_direction_args(inputs),
                                 inputs.diag, inputs.initial_state)
    return y, (final if want_final else None)
