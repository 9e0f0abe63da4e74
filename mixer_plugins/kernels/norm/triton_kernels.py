"""Fused gated RMSNorm in Triton: one kernel forward, one kernel backward (the ``triton`` backend of
:func:`mixer_plugins.kernels.gated_rmsnorm`).

Over the last dimension (``width``) of y and z, with ``s = silu(z)``::

    norm_before_gate=True:   out = w * y * r * s,   r = 1 / sqrt(mean(y^2) + eps)
    norm_before_gate=False:  out = w * u * r,       u = y * s,  r = 1 / sqrt(mean(u^2) + eps)

Forward: one program normalizes a tile of ``BLOCK_R`` whole rows (a row is one tile of ``BLOCK_W``, the width
rounded up to a power of two; rows wider than :data:`MAX_WIDTH` are refused, the ``torch`` backend takes them).
Everything is computed in float32 and the output has y's dtype. Nothing but the output is stored: the backward
recomputes ``r`` from its inputs.

Backward: with ``n = v r`` (``v = y`` or ``u``) and ``g`` the output gradient, ``dn = g w s`` (or ``g w``),
``dv = r (dn - n mean(dn n))``; before the gate ``dy = dv`` and ``dz = g w n silu'(z)``, after it ``dy = dv s`` and
``dz = dv y silu'(z)``; ``silu'(z) = sig(z) (1 + z (1 - sig(z)))``. The gain gradient is a column sum over all rows:
a fixed number of programs (a few per SM) each walk a contiguous range of row tiles and keep their column sums in
registers, writing one float32 row of partial sums each; one ``sum`` over those rows finishes it. No atomics, so the
result does not depend on the order programs run in.

Row indices are 64-bit before they are multiplied by a row stride; the grids are one-dimensional. Both directions are
``torch.library`` custom ops with fake kernels. Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` set before
this module is imported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._triton._common import MAX_GRID, available, cdiv, grid_1d, offset64, on_device, pow2, require, tl, triton

__all__ = ["MAX_GRID", "MAX_WIDTH", "available", "backward_programs", "forward_grid", "forward_layout",
           "gated_rmsnorm_triton", "persistent_programs"]

#: widest row the kernels take (a row is one register tile); wider rows run on the ``torch`` backend
MAX_WIDTH = 4096
#: elements of one program's tile (rows x padded width; one row if wider)
TILE_ELEMENTS = 2048
#: elements of a tile per thread (the warps follow, 1 to 16): 4 keeps the backward near 64 registers
ELEMENTS_PER_THREAD = 4
#: programs per SM of the backward's persistent grid (each keeps one row of partial gain sums)
PROGRAMS_PER_SM = 4
#: programs of a persistent grid off CUDA (the interpreter, or the compile check on CPU tensors)
PROGRAMS_OFF_CUDA = 4


def forward_layout(width: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_W, num_warps)`` for rows of ``width``: the width padded to a power of two, as many rows as
    fill :data:`TILE_ELEMENTS`, and the warps that give each thread :data:`ELEMENTS_PER_THREAD` of them (1 to 16)."""
    if width > MAX_WIDTH:
        raise ValueError(f"gated_rmsnorm (triton): width {width} is over the kernels' limit {MAX_WIDTH}")
    block_w = max(16, pow2(width))
    block_r = max(1, TILE_ELEMENTS // block_w)
    warps = min(16, max(1, block_r * block_w // (32 * ELEMENTS_PER_THREAD)))
    return block_r, block_w, warps


def forward_grid(rows: int, block_r: int) -> tuple[int]:
    """The forward's grid: one program per tile of ``block_r`` rows, on the first grid dimension."""
    return grid_1d(cdiv(rows, block_r), "gated_rmsnorm (triton)")


def persistent_programs(device: torch.device) -> int:
    """How many programs a persistent grid launches on ``device``: :data:`PROGRAMS_PER_SM` per SM on CUDA."""
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return PROGRAMS_OFF_CUDA


def backward_programs(rows: int, block_r: int, programs: int) -> tuple[int, int]:
    """``(programs, rows_per_program)`` of the backward: at most ``programs`` programs, each taking a contiguous
    range of whole row tiles (``rows_per_program`` is a multiple of ``block_r``), none empty."""
    tiles = cdiv(rows, block_r)
    per = max(1, cdiv(tiles, max(1, programs))) * block_r
    return cdiv(rows, per), per


if triton is not None:

    @triton.jit
    def _norm_fwd_kernel(
        y_ptr, z_ptr, w_ptr, out_ptr, R, W, stride_y, stride_z, stride_o, eps,
        BEFORE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_W)
        cmask = cols < W
        m = (rows < R)[:, None] & cmask[None, :]
        y = tl.load(y_ptr + offset64(rows, stride_y)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offset64(rows, stride_z)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        s = z * tl.sigmoid(z)
        v = y if BEFORE else y * s
        r = 1.0 / tl.sqrt(tl.sum(v * v, 1) / W + eps)
        out = v * r[:, None] * w[None, :]
        if BEFORE:
            out = out * s
        tl.store(out_ptr + offset64(rows, stride_o)[:, None] + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m)

    @triton.jit
    def _norm_bwd_kernel(
        g_ptr, y_ptr, z_ptr, w_ptr, dy_ptr, dz_ptr, dw_ptr, R, W, rows_per_program,
        stride_g, stride_y, stride_z, stride_dy, stride_dz, eps,
        BEFORE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        """Program p: the rows ``[p * rows_per_program, (p + 1) * rows_per_program)``, tile by tile; its column sums
        of the gain gradient go to row p of ``dw_ptr`` (programs, W), float32."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_W)
        cmask = cols < W
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_W], dtype=tl.float32)
        start = offset64(pid, rows_per_program)
        end = tl.minimum(start + rows_per_program, R)
        # a while loop: the interpreter cannot run range() over runtime scalars
        lo = start
        while lo < end:
            rows = lo + tl.arange(0, BLOCK_R)
            m = (rows < end)[:, None] & cmask[None, :]
            g = tl.load(g_ptr + offset64(rows, stride_g)[:, None] + cols[None, :], mask=m, other=0.0)
            y = tl.load(y_ptr + offset64(rows, stride_y)[:, None] + cols[None, :], mask=m, other=0.0)
            z = tl.load(z_ptr + offset64(rows, stride_z)[:, None] + cols[None, :], mask=m, other=0.0)
            g = g.to(tl.float32)
            y = y.to(tl.float32)
            z = z.to(tl.float32)
            sig = tl.sigmoid(z)
            s = z * sig
            v = y if BEFORE else y * s
            r = 1.0 / tl.sqrt(tl.sum(v * v, 1) / W + eps)
            n = v * r[:, None]
            gw = g * w[None, :]
            if BEFORE:
                dw += tl.sum(g * n * s, 0)
                dn = gw * s
            else:
                dw += tl.sum(g * n, 0)
                dn = gw
            c = tl.sum(dn * n, 1) / W
            dv = (dn - n * c[:, None]) * r[:, None]
            dsilu = sig * (1.0 + z * (1.0 - sig))
            if BEFORE:
                dy = dv
                dz = gw * n * dsilu
            else:
                dy = dv * s
                dz = dv * y * dsilu
            tl.store(dy_ptr + offset64(rows, stride_dy)[:, None] + cols[None, :], dy.to(dy_ptr.dtype.element_ty),
                     mask=m)
            tl.store(dz_ptr + offset64(rows, stride_dz)[:, None] + cols[None, :], dz.to(dz_ptr.dtype.element_ty),
                     mask=m)
            lo += BLOCK_R
        tl.store(dw_ptr + offset64(pid, W) + cols, dw, mask=cmask)


def _rows(t: Tensor, width: int) -> Tensor:
    """``t`` as (rows, width) with unit column stride (a view where possible)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _norm_fwd(y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
    width = y.shape[-1]
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    y2, z2, o2 = _rows(y, width), _rows(z, width), out.view(-1, width)
    block_r, block_w, warps = forward_layout(width)
    with on_device(y.device):
        _norm_fwd_kernel[forward_grid(y2.shape[0], block_r)](
            y2, z2, weight.contiguous(), o2, y2.shape[0], width, y2.stride(0), z2.stride(0), o2.stride(0), float(eps),
            BEFORE=bool(norm_before_gate), BLOCK_R=block_r, BLOCK_W=block_w, num_warps=warps)
    return out


def _norm_bwd(grad: Tensor, y: Tensor, z: Tensor, weight: Tensor, eps: float,
              norm_before_gate: bool) -> tuple[Tensor, Tensor, Tensor]:
    width = y.shape[-1]
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    if dy.numel() == 0:
        return dy, dz, torch.zeros_like(weight)
    g2, y2, z2 = _rows(grad, width), _rows(y, width), _rows(z, width)
    dy2, dz2 = dy.view(-1, width), dz.view(-1, width)
    rows = y2.shape[0]
    block_r, block_w, warps = forward_layout(width)
    programs, per = backward_programs(rows, block_r, persistent_programs(y.device))
    partial = torch.empty(programs, width, dtype=torch.float32, device=y.device)
    with on_device(y.device):
        _norm_bwd_kernel[grid_1d(programs, "gated_rmsnorm backward (triton)")](
            g2, y2, z2, weight.contiguous(), dy2, dz2, partial, rows, width, per,
            g2.stride(0), y2.stride(0), z2.stride(0), dy2.stride(0), dz2.stride(0), float(eps),
            BEFORE=bool(norm_before_gate), BLOCK_R=block_r, BLOCK_W=block_w, num_warps=warps)
    return dy, dz, partial.sum(0).to(weight.dtype)


@torch.library.custom_op("mixer_plugins::gated_rmsnorm_triton", mutates_args=())
def _norm_op(y: Tensor, z: Tensor, weight: Tensor, eps: float, norm_before_gate: bool) -> Tensor:
    """Fused gated RMSNorm forward over the last dimension; y's dtype, contiguous."""
    return _norm_fwd(y, z, weight, eps, norm_before_gate)


@_norm_op.register_fake
def _norm_op_fake(y, z, weight, eps, norm_before_gate):
    return y.new_empty(y.shape)


@torch.library.custom_op("mixer_plugins::gated_rmsnorm_triton_backward", mutates_args=())
def _norm_bwd_op(grad: Tensor, y: Tensor, z: Tensor, weight: Tensor, eps: float,
                 norm_before_gate: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Fused gated RMSNorm backward: (dy, dz, dweight) in the dtypes of y, z and weight."""
    return _norm_bwd(grad, y, z, weight, eps, norm_before_gate)


@_norm_bwd_op.register_fake
def _norm_bwd_op_fake(grad, y, z, weight, eps, norm_before_gate):
    return y.new_empty(y.shape), z.new_empty(z.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    y, z, weight, eps, norm_before_gate = inputs
    ctx.save_for_backward(y, z, weight)
    ctx.eps, ctx.norm_before_gate = eps, norm_before_gate


def _backward(ctx, grad):
    y, z, weight = ctx.saved_tensors
    dy, dz, dw = _norm_bwd_op(grad, y, z, weight, ctx.eps, ctx.norm_before_gate)
    need_y, need_z, need_w = ctx.needs_input_grad[:3]
    return dy if need_y else None, dz if need_z else None, dw if need_w else None, None, None


_norm_op.register_autograd(_backward, setup_context=_setup_context)


def gated_rmsnorm_triton(y: Tensor, z: Tensor, weight: Tensor, eps: float = 1e-5,
                         norm_before_gate: bool = True) -> Tensor:
    """Gated RMSNorm of ``y`` gated by ``z`` (same shape, width at most :data:`MAX_WIDTH`) with gain ``weight``
    (width,), as :func:`mixer_plugins.kernels.gated_rmsnorm`; differentiable in y, z and weight. Returns y's dtype."""
    require(y.device, "gated_rmsnorm")
    return _norm_op(y, z, weight, float(eps), bool(norm_before_gate))
