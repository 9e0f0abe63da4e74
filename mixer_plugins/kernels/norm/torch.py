"""``torch`` form of :func:`..gated_rmsnorm`: tile by tile, with a hand-written backward.

Written as ops on whole (tokens, width) tensors, the norm makes about eight full-size temporaries forward and twice
that backward, each (on CPU, past glibc's ``mmap`` threshold) paying the page faults of fresh memory. In tiles of
:data:`TILE_ELEMENTS` elements the temporaries stay small, cached and reused; the backward recomputes the per-tile
statistics instead of storing them.

Under ``torch.compile`` the plain formula (:func:`.reference.gated_rmsnorm_reference`) is traced instead:
the compiler fuses it. (On CPU the ``native`` backend, :mod:`.native`, runs first.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._library import Grads
from .._tiling import time_tiles
from .reference import gated_rmsnorm_reference

__all__ = ["TILE_ELEMENTS"]

TILE_ELEMENTS = 1 << 20  # elements of one tile's temporaries (4 MiB in float32)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _tiles(rows: int, width: int, device: torch.device) -> list[tuple[int, int]]:
    """Row ranges of the tiles (one tile off CPU, see :mod:`.._tiling`)."""
    return time_tiles(rows, width, TILE_ELEMENTS, device)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
        ctx.save_for_backward(y, z, weight)
        ctx.eps, ctx.norm_before_gate = eps, norm_before_gate
        dtype = y.dtype
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        y2, z2 = _rows(y), _rows(z)
        out = torch.empty(y2.shape, dtype=dtype, device=y.device)
        tiles = _tiles(y2.shape[0], y2.shape[1], y.device)
        _forward_tiles(y2, z2, weight.to(compute), out, tiles, eps, norm_before_gate, compute)
        return out.view(y.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Grads:
        rows = _rows(grad)
        return _backward(ctx, grad, _tiles(rows.shape[0], rows.shape[1], grad.device))


def _forward_tiles(y2: Tensor, z2: Tensor, w: Tensor, out: Tensor, tiles: list[tuple[int, int]], eps: float,
                   norm_before_gate: bool, compute: torch.dtype) -> None:
    """The forward, tile by tile, into ``out`` (rows x width).

    Every product is written in place (into the output rows when ``out`` has the compute dtype): a tile costs
    one ``silu``, one sum of squares (a matrix-vector product, no squared temporary) and three multiplies.
    """
    direct = out.dtype == compute
    for lo, hi in tiles:
        yt, gate = y2[lo:hi].to(compute), F.silu(z2[lo:hi].to(compute))
        o = out[lo:hi] if direct else torch.empty_like(gate)
        if norm_before_gate:
            torch.mul(yt, _inv_rms(yt, eps), out=o)
            o.mul_(gate)
        else:
            torch.mul(yt, gate, out=o)
            o.mul_(_inv_rms(o, eps))
        o.mul_(w)
        if not direct:
            out[lo:hi] = o


def _inv_rms(v: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(v^2, -1) + eps)`` of the rows of ``v`` (rows, 1), from the rows' 2-norms: one reduction,
    no squared temporary (``pow(2).mean`` allocates one and runs ~2.5x slower on CPU)."""
    ss = torch.linalg.vector_norm(v, dim=-1, keepdim=True).square_()
    return ss.div_(v.shape[-1]).add_(eps).rsqrt_()


def _backward(ctx: Any, grad: Tensor, tiles: list[tuple[int, int]]) -> Grads:
    """The backward of :class:`_GatedRMSNorm`, tile by tile (the per-tile statistics recomputed).

    With ``n = v / rms(v)`` (``v = y``, or ``v = y * silu(z)``), ``s`` the gate ``silu(z)`` and ``g`` the output
    gradient: ``dn = g w s`` (before the gate) or ``g w``, ``dv = r (dn - n mean(dn n))``, the gain gradient is the
    column sum of ``g s n`` (or ``g n``), and ``silu'(z) = sig(z) + s (1 - sig(z))``. The products are formed in
    place in a few tile-sized buffers and in the gradients' own rows.
    """
    y, z, weight = ctx.saved_tensors
    eps, before = ctx.eps, ctx.norm_before_gate
    dtype = y.dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    y2, z2, g2 = _rows(y), _rows(z), _rows(grad)
    w = weight.to(compute)
    width = y2.shape[-1]
    need_y, need_z, need_w = ctx.needs_input_grad[:3]
    direct = dtype == compute and z.dtype == compute
    grad_y = torch.empty(y2.shape, dtype=dtype, device=y.device) if need_y else None
    grad_z = torch.empty(z2.shape, dtype=z.dtype, device=z.device) if need_z else None
    grad_w = torch.zeros(width, dtype=compute, device=y.device)
    for lo, hi in tiles:
        yt, zt, gt = y2[lo:hi].to(compute), z2[lo:hi].to(compute), g2[lo:hi].to(compute)
        sig = torch.sigmoid(zt)
        gate = zt * sig                                   # silu(z)
        if before:
            r = _inv_rms(yt, eps)
            n = yt * r
        else:
            n = yt * gate
            r = _inv_rms(n, eps)
            n.mul_(r)
        gn = gt * n                                       # g n
        if before:
            gn.mul_(gate)                                 # g s n
        grad_w += gn.sum(0)
        m = (gn @ w[:, None]).div_(width)                 # mean(dn n): dn n = g w s n (or g w n)
        dn = torch.mul(gt, w, out=gn)                     # dn = g w s (or g w), in g n's buffer
        if before:
            if grad_z is not None:                        # g w n
                dz = torch.mul(dn, n, out=grad_z[lo:hi]) if direct else dn * n
            dn.mul_(gate)
        into = grad_y[lo:hi] if grad_y is not None and direct else None
        dv = torch.addcmul(dn, n, m, value=-1.0, out=into).mul_(r)  # r (dn - n m)
        if not before:
            # v = y s: dy = dv s, dz = dv y silu'(z)
            if grad_z is not None:
                dz = dv * yt
            if grad_y is not None:
                dv.mul_(gate)
        if grad_y is not None and into is None:
            grad_y[lo:hi] = dv
        if grad_z is not None:
            # silu'(z) = sig + s (1 - sig) = sig + s - s sig, built in sig's place
            dgate = sig.addcmul_(gate, sig, value=-1.0).add_(gate)
            dz.mul_(dgate)
            if not (before and direct):
                grad_z[lo:hi] = dz
    return (None if grad_y is None else grad_y.view(y.shape),
            None if grad_z is None else grad_z.view(z.shape),
            grad_w.to(weight.dtype) if need_w else None, None, None)


def norm_torch(y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
    """The tiled norm with its hand-written backward (the plain formula under ``torch.compile``)."""
    if torch.compiler.is_compiling() or y.numel() == 0:
        return gated_rmsnorm_reference(y, z, weight, eps, norm_before_gate)
    return _GatedRMSNorm.apply(y, z, weight, float(eps), bool(norm_before_gate))
