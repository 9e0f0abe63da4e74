"""``torch.library`` custom ops around the chunked scan, with fake (meta) kernels and FLOP formulas.

Why a custom op:

* ``torch.compile`` sees one opaque op with a fake implementation instead of tracing a Python loop over
  chunks;
* ``torch.utils.flop_counter.FlopCounterMode`` counts it with :func:`chunked_scan_flops` (registered below);
* the backward recomputes the forward under autograd instead of storing every intra-chunk tensor, so
  training memory is the inputs plus one chunked forward: linear in the sequence length, like the
  memory-efficient path of the Hydra code. (FlopCounterMode sees the recomputation's own matmuls.)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .scan_chunked import STATE_PASS_BLOCK, scan_chunked, slab_bounds, slab_chunks

__all__ = ["chunked_scan", "chunked_scan_flops"]

def _empty_like(x: Tensor) -> Tensor:
    return x.new_empty(0)


@torch.library.custom_op("mixer_plugins::chunked_scan", mutates_args=())
def chunked_scan(
    x: Tensor,
    dt_f: Optional[Tensor], A_f: Optional[Tensor], B_f: Optional[Tensor], C_f: Optional[Tensor],
    dt_b: Optional[Tensor], A_b: Optional[Tensor], B_b: Optional[Tensor], C_b: Optional[Tensor],
    diag: Optional[Tensor], seq_idx: Optional[Tensor], initial_state: Optional[Tensor],
    shift: bool, chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Forward and/or backward chunked scan; returns (y, final forward state or an empty tensor)."""
    if dt_f is not None:
        y, final = scan_chunked(
            x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, initial_state,
            shift=shift, chunk_size=chunk_size, return_final_state=True,
        )
        return y, final.clone()  # custom-op outputs must own their storage (final is a view of the states)
    y = scan_chunked(x, None, None, None, None, dt_b, A_b, B_b, C_b, diag, seq_idx, None,
                     shift=shift, chunk_size=chunk_size)
    return y, _empty_like(x)


@chunked_scan.register_fake
def _chunked_scan_fake(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, initial_state, shift, chunk_size):
    if dt_f is not None:
        b, _, h, p = x.shape
        return x.new_empty(x.shape), x.new_empty(b, h, p, B_f.shape[-1])
    return x.new_empty(x.shape), x.new_empty(0)


def _setup_context(ctx, inputs, output):
    (x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, initial_state, shift, chunk_size) = inputs
    ctx.save_for_backward(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, initial_state)
    ctx.shift = shift
    ctx.chunk_size = chunk_size


def _backward(ctx, grad_y, grad_final):
    # Recompute the forward under autograd (like activation checkpointing) and differentiate it: only the
    # op's inputs were stored, never its intra-chunk tensors.
    saved = ctx.saved_tensors
    seq_idx = saved[10]
    inputs = saved[:10] + saved[11:]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) if t is not None else None for t in inputs]
        x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, init = leaves
        want_final = dt_f is not None and grad_final is not None
        result = scan_chunked(x, dt_f, A_f, B_f, C_f, dt_b, A_b, B_b, C_b, diag, seq_idx, init,
                              shift=ctx.shift, chunk_size=ctx.chunk_size, return_final_state=want_final)
        outputs, grads_out = ([result[0], result[1]], [grad_y, grad_final]) if want_final else ([result], [grad_y])
        keep = [(o, g) for o, g in zip(outputs, grads_out) if g is not None]
        present = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad([o for o, _ in keep], present, [g for _, g in keep], allow_unused=True))
    full = [None if t is None else next(grads) for t in leaves]
    gx, gdt_f, gA_f, gB_f, gC_f, gdt_b, gA_b, gB_b, gC_b, gdiag, ginit = full
    return gx, gdt_f, gA_f, gB_f, gC_f, gdt_b, gA_b, gB_b, gC_b, gdiag, None, ginit, None, None


chunked_scan.register_autograd(_backward, setup_context=_setup_context)


def chunked_scan_flops(batch: int, length: int, heads: int, head_dim: int, groups: int, state: int,
                       directions: int, chunk_size: int) -> int:
    """FLOPs (2 per multiply-add) of the matmul work of one chunked scan.

    Per direction: the C.B products of each chunk (2 L Q n g), the chunk states (2 L h p n), the state
    read-out (2 L h p n) and the state pass between chunks (within each slab, blocks of S = min(32, slab)
    chunks: the states entering its chunks, a S x S product, and the state leaving it, a 1 x S product:
    2 (S^2 + S) h p n per block, none when S = 1); once for both directions: the summed
    intra-chunk block times x (2 L Q h p).
    Elementwise work (decays, masks, state passing) is not counted, as FlopCounterMode counts none.
    """
    chunk_size = min(chunk_size, length)
    padded = -(-length // chunk_size) * chunk_size
    chunks = padded // chunk_size
    state_pass = 0
    for lo, hi in slab_bounds(chunks, slab_chunks(batch, chunk_size, heads, max(head_dim, chunk_size, state))):
        block = min(STATE_PASS_BLOCK, hi - lo)
        if block > 1:  # a one-chunk block is an elementwise product, which FlopCounterMode does not count
            state_pass += -(-(hi - lo) // block) * (block * block + block)
    per_direction = (2 * padded * chunk_size * state * groups + 4 * padded * heads * head_dim * state
                     + 2 * state_pass * heads * head_dim * state)
    return batch * (directions * per_direction + 2 * padded * chunk_size * heads * head_dim)


@register_flop_formula(torch.ops.mixer_plugins.chunked_scan)
def _chunked_scan_flop_formula(x_shape, dt_f_shape, A_f_shape, B_f_shape, C_f_shape, dt_b_shape, A_b_shape,
                               B_b_shape, C_b_shape, diag_shape, seq_idx_shape, init_shape, shift, chunk_size,
                               *args, out_shape=None, **kwargs) -> int:
    b, l, h, p = x_shape
    b_shape = B_f_shape if B_f_shape is not None else B_b_shape
    directions = int(dt_f_shape is not None) + int(dt_b_shape is not None)
    return chunked_scan_flops(b, l, h, p, b_shape[2], b_shape[3], directions, chunk_size)
