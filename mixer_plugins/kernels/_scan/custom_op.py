"""The chunked scan as a ``torch.library`` custom op, with a fake (meta) kernel and a FLOP formula.

Why a custom op:

* ``torch.compile`` sees one opaque op with a fake implementation instead of tracing a Python loop over
  chunks;
* ``torch.utils.flop_counter.FlopCounterMode`` counts it with :func:`chunked_scan_flops` (registered below);
* the backward recomputes the forward under autograd instead of storing every intra-chunk tensor, so
  training memory is the inputs plus one chunked forward: linear in the sequence length, like the
  memory-efficient path of the Hydra code. (FlopCounterMode sees the recomputation's own matmuls.) The
  backward is a custom op too (``chunked_scan_backward``), so the compiler never traces the chunk loop.

The op's schema is flat (a custom op takes tensors, not dataclasses): :func:`_op_kwargs` flattens a
:class:`.inputs.ScanInputs` by name and :func:`_unflatten` rebuilds it, and the backward saves and reads its
tensors by name. Its outputs are contiguous, as its fake kernel says: the compiler plans memory from the
fake kernel's strides.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.flop_counter import register_flop_formula

from .._library import argument_names, save_tensors, saved_tensors
from .._threads import threads_for
from . import chunked, factored, native
from .inputs import Direction, ScanInputs

__all__ = ["chunked_scan", "chunked_scan_backward", "chunked_scan_flops", "run_chunked"]

_DIRECTION_FIELDS = ("dt", "A", "B", "C")


def _scan(inputs: ScanInputs, *, return_final_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The chunked scan of ``inputs``: with factored decays (:func:`.factored.scan_factored`) where that path
    applies, else the general path (:func:`.chunked.scan_chunked`). Same result, up to rounding."""
    result = factored.scan_factored(inputs, return_final_state=return_final_state)
    if result is None:
        result = chunked.scan_chunked(inputs, return_final_state=return_final_state)
    return result


@torch.library.custom_op("mixer_plugins::chunked_scan", mutates_args=())
def chunked_scan(
    x: Tensor,
    dt_f: Optional[Tensor], A_f: Optional[Tensor], B_f: Optional[Tensor], C_f: Optional[Tensor],
    dt_b: Optional[Tensor], A_b: Optional[Tensor], B_b: Optional[Tensor], C_b: Optional[Tensor],
    diag: Optional[Tensor], seq_idx: Optional[Tensor], initial_state: Optional[Tensor],
    shift: bool, chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Forward and/or backward chunked scan; returns (y, final forward state or an empty tensor), contiguous."""
    inputs = _unflatten(locals())  # the arguments, by name
    with threads_for(chunked.tile_elements(inputs), x.device):
        if inputs.forward is None:
            return _scan(inputs).contiguous(), x.new_empty(0)
        y, final = _scan(inputs, return_final_state=True)
    # outputs own their storage (final is a view of the states) and have the fake kernel's strides
    return y.contiguous(), final.clone(memory_format=torch.contiguous_format)


@chunked_scan.register_fake
def _chunked_scan_fake(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, initial_state, shift, chunk_size):
    if dt_f is not None:
        b, _, h, p = x.shape
        return x.new_empty(x.shape), x.new_empty(b, h, p, B_f.shape[-1])
    return x.new_empty(x.shape), x.new_empty(0)


_ARGUMENTS = argument_names(torch.ops.mixer_plugins.chunked_scan.default)


def _op_kwargs(inputs: ScanInputs) -> dict[str, Any]:
    """``inputs`` as the op's keyword arguments."""
    kwargs: dict[str, Any] = {"x": inputs.x, "diag": inputs.diag, "seq_idx": inputs.seq_idx,
                              "initial_state": inputs.initial_state, "shift": bool(inputs.shift),
                              "chunk_size": int(inputs.chunk_size)}
    for suffix, direction in (("f", inputs.forward), ("b", inputs.backward)):
        for field in _DIRECTION_FIELDS:
            kwargs[f"{field}_{suffix}"] = None if direction is None else getattr(direction, field)
    return kwargs


def _unflatten(kwargs: dict[str, Any]) -> ScanInputs:
    """The op's arguments, by name, back into :class:`ScanInputs`."""
    directions = {
        suffix: Direction(*(kwargs[f"{field}_{suffix}"] for field in _DIRECTION_FIELDS))
        if kwargs[f"dt_{suffix}"] is not None else None
        for suffix in ("f", "b")
    }
    return ScanInputs(x=kwargs["x"], forward=directions["f"], backward=directions["b"], diag=kwargs["diag"],
                      seq_idx=kwargs["seq_idx"], initial_state=kwargs["initial_state"], shift=kwargs["shift"],
                      chunk_size=kwargs["chunk_size"])


_TENSOR_ARGUMENTS = tuple(name for name in _ARGUMENTS if name not in ("shift", "chunk_size"))
_DIFFERENTIABLE = tuple(name for name in _TENSOR_ARGUMENTS if name != "seq_idx")


def _setup_context(ctx, inputs, output):
    named = dict(zip(_ARGUMENTS, inputs))
    save_tensors(ctx, **{name: named[name] for name in _TENSOR_ARGUMENTS})
    ctx.shift = named["shift"]
    ctx.chunk_size = named["chunk_size"]


@torch.library.custom_op("mixer_plugins::chunked_scan_backward", mutates_args=())
def chunked_scan_backward(
    grad_y: Tensor, grad_final: Optional[Tensor],
    x: Tensor,
    dt_f: Optional[Tensor], A_f: Optional[Tensor], B_f: Optional[Tensor], C_f: Optional[Tensor],
    dt_b: Optional[Tensor], A_b: Optional[Tensor], B_b: Optional[Tensor], C_b: Optional[Tensor],
    diag: Optional[Tensor], seq_idx: Optional[Tensor], initial_state: Optional[Tensor],
    shift: bool, chunk_size: int,
) -> list[Tensor]:
    """Gradients of :func:`chunked_scan` w.r.t. its differentiable inputs (``x, dt_f, ..., diag,
    initial_state``, in schema order), contiguous; an empty tensor for an input that is None.

    It recomputes the forward (like activation checkpointing) and differentiates it with autograd: only
    the op's inputs were stored, never its intra-chunk tensors. A custom op of its own, so that the compiler sees
    one opaque backward instead of tracing the chunk loop and its gradient (minutes of inductor compilation).
    """
    named = {k: v for k, v in locals().items() if k not in ("grad_y", "grad_final")}
    want_final = named["dt_f"] is not None and grad_final is not None
    with _autograd_in_kernel(), threads_for(chunked.tile_elements(_unflatten(named)), x.device):
        leaves = {name: named[name].detach().requires_grad_(True) for name in _DIFFERENTIABLE
                  if named[name] is not None}
        inputs = _unflatten({**named, **leaves})
        if want_final:
            y, final = _scan(inputs, return_final_state=True)
            outputs, grads_out = [y, final], [grad_y, grad_final]
        else:
            outputs, grads_out = [_scan(inputs)], [grad_y]
        grads = dict(zip(leaves, torch.autograd.grad(outputs, list(leaves.values()), grads_out,
                                                     allow_unused=True)))
    return [x.new_empty(0) if name not in grads else torch.zeros_like(named[name]) if grads[name] is None
            else grads[name].contiguous() for name in _DIFFERENTIABLE]


#: The autograd dispatch keys a custom op's kernel runs below (the dispatcher excludes them while it runs).
_AUTOGRAD_KEYS = tuple(key for name, key in torch._C.DispatchKey.__members__.items() if name.startswith("Autograd"))


@contextlib.contextmanager
def _autograd_in_kernel() -> Iterator[None]:
    """Autograd inside a custom op's kernel: the dispatcher runs a kernel with the autograd keys excluded (and the
    backward with grad mode off); let them through again, so the kernel can differentiate its recomputed forward
    with ``torch.autograd.grad``, and the tensors it returns carry no graph."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


@chunked_scan_backward.register_fake
def _chunked_scan_backward_fake(grad_y, grad_final, x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx,
                                initial_state, shift, chunk_size):
    named = {"x": x, "dt_f": dt_f, "A_f": A_f, "B_f": B_f, "C_f": C_f, "dt_b": dt_b, "A_b": A_b, "B_b": B_b,
             "C_b": C_b, "diag": diag, "initial_state": initial_state}
    return [x.new_empty(0) if named[name] is None else named[name].new_empty(named[name].shape)
            for name in _DIFFERENTIABLE]


def _backward(ctx, grad_y, grad_final):
    saved = vars(saved_tensors(ctx))
    want_final = saved["dt_f"] is not None and grad_final is not None
    grads = chunked_scan_backward(grad_y.contiguous(), grad_final.contiguous() if want_final else None,
                                  **{name: saved[name] for name in _TENSOR_ARGUMENTS},
                                  shift=ctx.shift, chunk_size=ctx.chunk_size)
    by_name = {name: grad for name, grad in zip(_DIFFERENTIABLE, grads) if saved[name] is not None}
    return tuple(by_name.get(name) for name in _ARGUMENTS)


chunked_scan.register_autograd(_backward, setup_context=_setup_context)


class _EagerScan(torch.autograd.Function):
    """The eager path: the chunked scan under plain autograd (its intra-chunk tensors are kept, nothing is
    recomputed), wrapped so that its backward, too, runs with the threads :mod:`.._threads` picks for its size.

    The forward builds the scan's own autograd graph on detached copies of the inputs; the backward runs that
    graph (``torch.autograd.grad``) inside the thread setting. Not differentiable twice (it says so).
    """

    @staticmethod
    def forward(ctx, options: dict[str, Any], *tensors: Tensor | None):
        names = options["names"]
        need = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) if t is not None and wants else t
                      for t, wants in zip(tensors, need)]
            inputs = _unflatten({**dict(zip(names, leaves)), "shift": options["shift"],
                                 "chunk_size": options["chunk_size"]})
            ctx.elements, ctx.device = chunked.tile_elements(inputs), inputs.x.device
            with threads_for(ctx.elements, ctx.device):
                result = _scan(inputs, return_final_state=options["want_final"])
        outputs = list(result) if options["want_final"] else [result]
        ctx.inner = (outputs, [(i, t) for i, (t, wants) in enumerate(zip(leaves, need)) if wants and t is not None])
        return tuple(o.detach() for o in outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads_out: Tensor | None):
        outputs, wanted = ctx.inner
        ctx.inner = None  # the inner graph is freed with this backward
        grads: list[Tensor | None] = [None] * (len(ctx.needs_input_grad) - 1)
        keep = [(o, g) for o, g in zip(outputs, grads_out) if g is not None and o.requires_grad]
        if keep and wanted:
            with threads_for(ctx.elements, ctx.device):
                found = torch.autograd.grad([o for o, _ in keep], [t for _, t in wanted], [g for _, g in keep],
                                            allow_unused=True)
            for (i, _), g in zip(wanted, found):
                grads[i] = g
        return (None, *grads)


def run_chunked(inputs: ScanInputs, *, want_final: bool) -> tuple[Tensor, Tensor | None]:
    """The chunked scan: plain autograd in eager mode (fastest), the custom op under ``torch.compile``.
    Returns (y, the forward direction's final state when ``want_final``, else None).

    Eager autograd keeps the intra-chunk tensors for the backward (memory O(L * chunk_size) per head, linear
    in L); the custom op is opaque to the compiler (fake kernel) and recomputes them in its backward. Both run
    forward and backward with the threads :mod:`.._threads` picks for the scan's size.
    """
    if torch.compiler.is_compiling():
        y, final = chunked_scan(**_op_kwargs(inputs))
        return y, (final if want_final else None)
    if native.applies(inputs):  # our CPU kernel: no chunk-sized tensor kept or allocated (see .native)
        return native.run_native(inputs, want_final=want_final)
    kwargs = _op_kwargs(inputs)
    names = tuple(_TENSOR_ARGUMENTS)
    tensors = [kwargs[name] for name in names]
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
        with threads_for(chunked.tile_elements(inputs), inputs.x.device):
            result = _scan(inputs, return_final_state=want_final)
        return (result[0], result[1]) if want_final else (result, None)
    options = {"names": names, "shift": kwargs["shift"], "chunk_size": kwargs["chunk_size"], "want_final": want_final}
    out = _EagerScan.apply(options, *tensors)
    return (out[0], out[1]) if want_final else (out[0], None)


def chunked_scan_flops(batch: int, length: int, heads: int, head_dim: int, groups: int, state: int,
                       directions: int, chunk_size: int, *, initial_state: bool = False,
                       final_state: bool = False) -> int:
    """FLOPs (2 per multiply-add) of the matmul work of one chunked scan.

    The chunks are those the scan uses, :func:`.chunked.chunk_length` tokens each (Q). Per direction: the C.B
    products of each chunk (2 L Q n g), the chunk states (2 L h p n) and the state read-out (2 L h p n) (the state
    pass between chunks is a chunk-by-chunk elementwise recurrence, not counted); once for both directions: the
    summed intra-chunk block times x (2 L Q h p). The read-out of a state that is known to be zero is skipped: a
    sequence that is one chunk (no longer than ``chunk_size``) has no states at all unless the forward direction
    has an ``initial_state`` or returns its ``final_state`` (its states are then counted, and its read-out with an
    initial state); when every tile is one chunk, the first chunk of each direction (the last one, right to left)
    reads out nothing, except the forward direction's with an initial state.
    Elementwise work (decays, masks, state passing) is not counted, as FlopCounterMode counts none.
    """
    chunk_size = chunked.chunk_length(length, chunk_size, heads, head_dim, groups, state, directions)
    padded = -(-length // chunk_size) * chunk_size
    chunks = padded // chunk_size
    block_product = 2 * padded * chunk_size * heads * head_dim
    products = 2 * padded * chunk_size * state * groups
    one_pass = 2 * padded * heads * head_dim * state  # the chunk states, or their read-out
    if chunks == 1:
        fwd_states = one_pass * (int(initial_state or final_state) + int(initial_state))
        return batch * (directions * products + fwd_states + block_product)
    per_tile = chunked.tile_chunks(batch, chunk_size, heads, max(head_dim, chunk_size, state))
    per_direction = products + 2 * one_pass
    skipped = (directions - int(initial_state)) * one_pass // chunks if per_tile == 1 else 0
    return batch * (directions * per_direction + block_product - skipped)


@register_flop_formula(torch.ops.mixer_plugins.chunked_scan)
def _chunked_scan_flop_formula(x_shape, dt_f_shape, A_f_shape, B_f_shape, C_f_shape, dt_b_shape, A_b_shape,
                               B_b_shape, C_b_shape, diag_shape, seq_idx_shape, init_shape, shift, chunk_size,
                               *args, out_shape=None, **kwargs) -> int:
    b, l, h, p = x_shape
    b_shape = B_f_shape if B_f_shape is not None else B_b_shape
    directions = int(dt_f_shape is not None) + int(dt_b_shape is not None)
    # the op always returns the forward direction's final state
    return chunked_scan_flops(b, l, h, p, b_shape[2], b_shape[3], directions, chunk_size,
                              initial_state=init_shape is not None, final_state=dt_f_shape is not None)
