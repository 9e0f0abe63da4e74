"""``native`` form of the scan: our C++ CPU engine (``kernels/_native/scan.cpp``), chosen first on CPU.

The engine runs the chunked algorithm of :mod:`.chunked` with its per-chunk work in small thread-local buffers and
a written-out backward (it stores only its inputs: training memory is linear in the length with a small constant).
Every log decay is summed over its own tokens (each pair's, each read-out's prefix, each state's suffix), never
formed as a difference of chunk-wide cumulative sums, so float32 keeps the reference's accuracy at any chunk size
and the decay gradient stays right at any decay. The products that do not depend on a head (``C~ B^T``, the
chunks' states and read-outs) are shared by a group's heads. A short sequence runs as one chunk with no state work
at all (:func:`.inputs.chunk_length`).

It takes eager CPU calls in float32 or float64 (every tensor of ``x``'s dtype) without ``seq_idx``; elsewhere (and
under ``torch.compile``, which traces the ``torch`` backend) the scan's ``why_not`` says why not and the next form runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._library import Grads, Shape
from .._native_check import require_native
from .flops import chunked_scan_flops
from .inputs import Direction, chunk_length

__all__ = ["native_scan", "native_scan_backward", "scan_native"]

OptTensor = Optional[Tensor]
OptShape = Optional[Shape]


def _dense(*tensors: Tensor | None) -> list[Tensor | None]:
    return [None if t is None else t.contiguous() for t in tensors]


def _rows_dense(x: Tensor) -> Tensor:
    """``x`` (B, L, H, P) as the engine reads it: any batch and row strides (a slice of a wider projection is read
    in place), heads and channels dense; copied only otherwise."""
    _, _, heads, head_dim = x.shape
    if (head_dim <= 1 or x.stride(3) == 1) and (heads <= 1 or x.stride(2) == head_dim):
        return x
    return x.contiguous()


@torch.library.custom_op("mixer_plugins::native_scan", mutates_args=())
def native_scan(x: Tensor, dt_f: Optional[Tensor], A_f: Optional[Tensor], B_f: Optional[Tensor],
                C_f: Optional[Tensor], dt_b: Optional[Tensor], A_b: Optional[Tensor], B_b: Optional[Tensor],
                C_b: Optional[Tensor], diag: Optional[Tensor], init: Optional[Tensor], shift: bool, chunk: int,
                want_final: bool) -> tuple[Tensor, Tensor]:
    """The engine's forward (inputs of one dtype, any strides): y and the final state (empty unless
    ``want_final``). ``x`` is read in place when its heads and channels are dense (a slice of a projection); other
    inputs get contiguous copies, made here for the call only: autograd keeps the inputs as given (views of a
    projection share its storage), and the backward makes its own copies."""
    require_native()
    y, final = torch.ops.mixer_plugins_native.scan_forward(_rows_dense(x),
                                                           *_dense(dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, init),
                                                           shift, chunk, want_final)
    if diag is not None:
        y.addcmul_(x, diag[..., None])
    return y, final


@native_scan.register_fake
def _native_scan_fake(x: Tensor, dt_f: OptTensor, A_f: OptTensor, B_f: OptTensor, C_f: OptTensor, dt_b: OptTensor,
                      A_b: OptTensor, B_b: OptTensor, C_b: OptTensor, diag: OptTensor, init: OptTensor, shift: bool,
                      chunk: int, want_final: bool) -> tuple[Tensor, Tensor]:
    B = B_f if B_f is not None else B_b
    assert B is not None, "a scan has at least one direction"
    state = B.shape[-1]
    final = x.new_empty(x.shape[0], x.shape[2], x.shape[3], state) if want_final else x.new_empty(0)
    return x.new_empty(x.shape), final


@torch.library.custom_op("mixer_plugins::native_scan_backward", mutates_args=())
def native_scan_backward(dy: Tensor, dfinal: Optional[Tensor], x: Tensor, dt_f: Optional[Tensor],
                         A_f: Optional[Tensor], B_f: Optional[Tensor], C_f: Optional[Tensor], dt_b: Optional[Tensor],
                         A_b: Optional[Tensor], B_b: Optional[Tensor], C_b: Optional[Tensor], diag: Optional[Tensor],
                         init: Optional[Tensor], shift: bool, chunk: int) -> list[Tensor]:
    """The gradients of :func:`native_scan` with respect to ``x, dt_f, ..., C_b, diag, init`` (an empty tensor for
    an input that is None)."""
    out = torch.ops.mixer_plugins_native.scan_backward(*_dense(dy, dfinal), _rows_dense(x),
                                                       *_dense(dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, init),
                                                       shift, chunk)
    dx, ddiag = out[0], x.new_empty(0)
    if diag is not None:
        dx.addcmul_(dy, diag[..., None])
        ddiag = (dy * x).sum(-1).contiguous()
    # an absent input's gradient is an empty tensor of its own (outputs of a custom op never alias each other)
    return [g if g.numel() else x.new_empty(0) for g in (dx, *out[1:9], ddiag, out[9])]


@native_scan_backward.register_fake
def _native_scan_backward_fake(dy: Tensor, dfinal: OptTensor, x: Tensor, dt_f: OptTensor, A_f: OptTensor,
                               B_f: OptTensor, C_f: OptTensor, dt_b: OptTensor, A_b: OptTensor, B_b: OptTensor,
                               C_b: OptTensor, diag: OptTensor, init: OptTensor, shift: bool, chunk: int
                               ) -> list[Tensor]:
    def like(t: OptTensor) -> Tensor:
        return x.new_empty(0) if t is None else t.new_empty(t.shape)   # contiguous, as the real kernel's
    return [like(x), like(dt_f), like(A_f), like(B_f), like(C_f), like(dt_b), like(A_b), like(B_b), like(C_b),
            like(diag), like(init)]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init, shift, chunk, want_final = inputs
    ctx.save_for_backward(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init)
    ctx.shift, ctx.chunk = shift, chunk
    ctx.set_materialize_grads(False)   # an unused output's gradient stays None: no zero-filled work


def _backward(ctx: Any, dy: Tensor | None, dfinal: Tensor | None) -> Grads:
    saved = ctx.saved_tensors
    x = saved[0]
    dy = torch.zeros_like(x) if dy is None else dy
    if dfinal is not None and dfinal.numel() == 0:
        dfinal = None
    grads = native_scan_backward(dy, dfinal, *saved, ctx.shift, ctx.chunk)
    return (*[None if t is None else g for g, t in zip(grads, saved)], None, None, None)


native_scan.register_autograd(_backward, setup_context=_setup_context)


def _scan_flops(x_shape: Shape, dt_f_shape: Shape | None, B_f_shape: Shape | None, dt_b_shape: Shape | None,
                B_b_shape: Shape | None, init_shape: Shape | None, chunk: int, want_final: bool) -> int:
    b, length, heads, head_dim = x_shape
    B_shape = B_f_shape if B_f_shape is not None else B_b_shape
    assert B_shape is not None, "a scan has at least one direction"
    groups, state = B_shape[2:]
    directions = int(dt_f_shape is not None) + int(dt_b_shape is not None)
    return chunked_scan_flops(b, length, heads, head_dim, groups, state, directions, chunk, chunk_is_final=True,
                              initial_state=init_shape is not None, final_state=want_final)


@register_flop_formula(torch.ops.mixer_plugins.native_scan)
def _forward_flops(x: Shape, dt_f: OptShape, A_f: OptShape, B_f: OptShape, C_f: OptShape, dt_b: OptShape,
                   A_b: OptShape, B_b: OptShape, C_b: OptShape, diag: OptShape, init: OptShape, shift: bool,
                   chunk: int, want_final: bool, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _scan_flops(x, dt_f, B_f, dt_b, B_b, init, chunk, want_final)


@register_flop_formula(torch.ops.mixer_plugins.native_scan_backward)
def _backward_flops(dy: Shape, dfinal: OptShape, x: Shape, dt_f: OptShape, A_f: OptShape, B_f: OptShape,
                    C_f: OptShape, dt_b: OptShape, A_b: OptShape, B_b: OptShape, C_b: OptShape, diag: OptShape,
                    init: OptShape, shift: bool, chunk: int, *args: Any, out_shape: Any = None,
                    **kwargs: Any) -> int:
    # the engine's backward does about twice the forward's products
    return 2 * _scan_flops(x, dt_f, B_f, dt_b, B_b, init, chunk, dfinal is not None)


def scan_native(x: Tensor, forward: Direction | None, backward: Direction | None = None, *,
                diag: Tensor | None = None, initial_state: Tensor | None = None, shift: bool = False,
                chunk_size: int = 64, return_final_state: bool = False) -> tuple[Tensor, Tensor | None]:
    """The scan of ``x`` (b, l, h, p) on the native engine, every tensor in one dtype (step sizes prepared, ``A`` the
    rates): (y, the forward direction's final state when ``return_final_state``, else None). Differentiable once."""
    _, length, heads, head_dim = x.shape
    state = (forward or backward).B.shape[-1]  # type: ignore[union-attr]
    chunk = chunk_length(length, chunk_size, heads, head_dim, state)
    f = [None] * 4 if forward is None else list(forward)
    b = [None] * 4 if backward is None else list(backward)
    y, final = native_scan(x, *f, *b, diag, initial_state, shift, chunk, return_final_state)
    return y, (final if return_final_state else None)
