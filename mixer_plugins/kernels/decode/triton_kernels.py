"""One decoding step of an SSD-style block in Triton (the ``triton`` backend of
:func:`mixer_plugins.kernels.decode.ssd_decode_step`; the formulas are stated there).

Two launches, one after the other on the current stream:

1. :func:`_decode_step_kernel`, one program per (batch row, head, block of ``BLOCK_P`` rows of the head's state):
   the convolution's output for the new token at the program's own ``x`` channels and at its group's ``B`` and ``C``
   channels (from the window ``[conv_state[:, 1:], xbc]``, bias, SiLU), the head's step size and decay, the state
   rows' update ``s <- exp(A dt) s + (dt x_i) B`` (in place) and ``y_i = scale * s.C + D_i x_i``. It only *reads*
   ``conv_state``.
2. :func:`_roll_windows_kernel`, one program per (batch row, block of channels): every channel's window moves one
   step, ``conv_state <- [conv_state[:, 1:], xbc]``, in place.

Why two, and why this split: the ``B`` and ``C`` channels are shared by the heads of a group, so a program per
(row, head) that rolled its group's windows itself would race with the other heads' programs still reading them.
Launch 1 therefore never writes a window; each of its programs recomputes its group's ``B`` and ``C`` convolution
(``2 d_state kernel`` multiply-adds over a few KiB that the group's programs read from L2), and launch 2, ordered
after it on the stream, rolls the windows once. The alternatives cost more where decoding spends its time: one
program per (row, group) is race-free in one launch but leaves most of the GPU idle at small batches (at batch 1
and one group, one program walks every head's state); a convolution launch writing the convolved ``xbc`` to a
buffer read by a state launch needs a workspace besides the output. Here the output ``y`` is the only allocation, so
the step is captured by a CUDA graph as it is.

Everything is computed in float32: the inputs are read in their dtypes (``xbc``, ``dt`` may be bfloat16 views of a
fused projection; the states float32 under a bfloat16 model), the states are written back in theirs and ``y`` in
``xbc``'s. Every tensor is read through its strides (nothing is copied); batch-row offsets are 64-bit
(:func:`.._triton._common.offset64`), offsets within a row 32-bit. The grids are one-dimensional.

The step is a ``torch.library`` custom op that mutates ``conv_state`` and ``state`` (declared), with a fake kernel, so
``torch.compile(fullgraph=True)`` sees one opaque op. Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` set
before this module is imported.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._triton._common import available, cdiv, grid_1d, offset64, on_device, pow2, tl, triton

__all__ = ["MAX_D_STATE", "MAX_TAPS", "available", "roll_layout", "ssd_decode_step_triton", "step_layout"]

#: longest convolution kernel the step takes (the window is a register tile); longer ones run on the torch backend
MAX_TAPS = 16
#: widest state (d_state) the step takes (a state row is a register tile); wider ones run on the torch backend
MAX_D_STATE = 512
#: elements of one program's state tile (rows x padded d_state) in launch 1
STATE_TILE = 2048
#: channels of one program in launch 2
ROLL_CHANNELS = 256
#: warps of both launches
WARPS = 4


def step_layout(batch: int, heads: int, head_dim: int, d_state: int, taps: int) -> tuple[tuple[int], dict[str, int]]:
    """Launch 1's one-dimensional grid (one program per batch row, head and block of state rows) and its blocks: the
    padded d_state, as many rows as fill :data:`STATE_TILE` (at most the padded head_dim), the padded kernel."""
    block_n = pow2(d_state)
    block_p = min(pow2(head_dim), max(1, STATE_TILE // block_n))
    npb = cdiv(head_dim, block_p)
    grid = grid_1d(batch * heads * npb, "ssd_decode_step (triton)")
    return grid, dict(NPB=npb, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_K=pow2(taps), num_warps=WARPS)


def roll_layout(batch: int, channels: int, taps: int) -> tuple[tuple[int], dict[str, int]]:
    """Launch 2's one-dimensional grid (one program per batch row and block of channels) and its blocks."""
    block_c = min(ROLL_CHANNELS, pow2(channels))
    ncb = cdiv(channels, block_c)
    grid = grid_1d(batch * ncb, "ssd_decode_step conv_state (triton)")
    return grid, dict(NCB=ncb, BLOCK_C=block_c, BLOCK_K=pow2(taps), num_warps=WARPS)


if triton is not None:
    from ..scan.triton_kernels import _softplus

    @triton.jit
    def _window(cs_row, xbc_row, c, cmask, K, s_cc, s_ck, DTYPE: tl.constexpr, BLOCK_K: tl.constexpr):
        """The window after the step at channels ``c`` of one batch row, (len(c), BLOCK_K) in ``DTYPE``: taps
        ``j < K - 1`` are ``conv_state[c, j + 1]``, tap ``K - 1`` the new input ``xbc[c]``, padding 0."""
        j = tl.arange(0, BLOCK_K)[None, :]
        old = tl.load(cs_row + c[:, None] * s_cc + (j + 1) * s_ck, mask=cmask[:, None] & (j + 1 < K), other=0.0)
        new = tl.load(xbc_row + c, mask=cmask, other=0.0)
        return tl.where(j == K - 1, new.to(DTYPE)[:, None], old.to(DTYPE))

    @triton.jit
    def _conv_out(cs_row, xbc_row, w_ptr, bias_ptr, c, cmask, K, s_cc, s_ck, s_wc, s_wk, s_bias,
                  HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_K: tl.constexpr):
        """The convolution's output for the new token at channels ``c`` (0 where masked), float32:
        ``bias[c] + sum_j weight[c, j] window[c, j]``, then SiLU."""
        j = tl.arange(0, BLOCK_K)[None, :]
        win = _window(cs_row, xbc_row, c, cmask, K, s_cc, s_ck, tl.float32, BLOCK_K)  # the new input unrounded
        w = tl.load(w_ptr + c[:, None] * s_wc + j * s_wk, mask=cmask[:, None] & (j < K), other=0.0)
        out = tl.sum(win * w.to(tl.float32), 1)
        if HAS_BIAS:
            out += tl.load(bias_ptr + c * s_bias, mask=cmask, other=0.0).to(tl.float32)
        if SILU:
            out = out * tl.sigmoid(out)
        return out

    @triton.jit
    def _step_size(dt_ptr, A_ptr, bias_ptr, b, h, s_dtb, s_dth, s_A, s_bias, lo, hi,
                   HAS_DT: tl.constexpr, HAS_A: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                   CLAMP: tl.constexpr):
        """Head ``h``'s step size ``clamp(softplus(dt + dt_bias), lo, hi)`` (each part optional; 1 without dt) and
        its decay ``exp(A dt)`` with ``A = -exp(A_log)`` (1 without A_log), float32."""
        if HAS_DT:
            dt = tl.load(dt_ptr + offset64(b, s_dtb) + h * s_dth).to(tl.float32)
            if HAS_DT_BIAS:
                dt += tl.load(bias_ptr + h * s_bias).to(tl.float32)
            if SOFTPLUS:
                dt = _softplus(dt)
            if CLAMP:
                dt = tl.minimum(tl.maximum(dt, lo), hi)
        else:
            dt = 1.0
        if HAS_A:
            decay = tl.exp(-tl.exp(tl.load(A_ptr + h * s_A).to(tl.float32)) * dt)
        else:
            decay = 1.0
        return dt, decay

    @triton.jit
    def _state_step(s_head, rows, cols, rmask, nmask, s_sp, s_sn, x, Bv, Cv, dt, decay):
        """The state rows ``rows`` of one head, ``s <- decay s + (dt x_i) B`` (read and written in place, in the
        state's dtype, computed in float32); returns their read-out ``s.C`` (float32)."""
        ptrs = s_head + rows[:, None] * s_sp + cols[None, :] * s_sn
        m = rmask[:, None] & nmask[None, :]
        s = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
        s = s * decay + (dt * x)[:, None] * Bv[None, :]
        tl.store(ptrs, s.to(s_head.dtype.element_ty), mask=m)
        return tl.sum(s * Cv[None, :], 1)

    @triton.jit
    def _skip(D_ptr, h, rows, rmask, s_Dh, s_Dp, d_scalar, x, D_MODE: tl.constexpr):
        """``D x`` at the head's ``rows``: D_MODE 1 a number, 2 one per head, 3 one per channel."""
        if D_MODE == 1:
            return d_scalar * x
        elif D_MODE == 2:
            return tl.load(D_ptr + h * s_Dh).to(tl.float32) * x
        else:
            return tl.load(D_ptr + h * s_Dh + rows * s_Dp, mask=rmask, other=0.0).to(tl.float32) * x

    @triton.jit
    def _decode_step_kernel(
        xbc_ptr, cs_ptr, w_ptr, bias_ptr, state_ptr, dt_ptr, A_ptr, D_ptr, dt_bias_ptr, y_ptr,
        H, P, N, K, NPB, heads_per_group, b_off, c_off,
        s_xb, s_csb, s_csc, s_csk, s_wc, s_wk, s_bias, s_sb, s_sh, s_sp, s_sn,
        s_dtb, s_dth, s_A, s_Dh, s_Dp, s_dtbias, s_yb,
        d_scalar, lo, hi, scale,
        HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_DT: tl.constexpr, HAS_A: tl.constexpr,
        HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr, D_MODE: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Launch 1 (see the module docstring): program (b, h, row block), row blocks fastest, so that a group's
        programs run side by side and read its B, C windows from cache."""
        pid = tl.program_id(0)
        pb = pid % NPB
        rest = pid // NPB
        h = rest % H
        b = rest // H
        g = h // heads_per_group
        rows = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        rmask = rows < P
        cols = tl.arange(0, BLOCK_N)
        nmask = cols < N
        xbc_row = xbc_ptr + offset64(b, s_xb)
        cs_row = cs_ptr + offset64(b, s_csb)
        x = _conv_out(cs_row, xbc_row, w_ptr, bias_ptr, h * P + rows, rmask, K, s_csc, s_csk, s_wc, s_wk, s_bias,
                      HAS_BIAS, SILU, BLOCK_K)
        Bv = _conv_out(cs_row, xbc_row, w_ptr, bias_ptr, b_off + g * N + cols, nmask, K, s_csc, s_csk, s_wc, s_wk,
                       s_bias, HAS_BIAS, SILU, BLOCK_K)
        Cv = _conv_out(cs_row, xbc_row, w_ptr, bias_ptr, c_off + g * N + cols, nmask, K, s_csc, s_csk, s_wc, s_wk,
                       s_bias, HAS_BIAS, SILU, BLOCK_K)
        dt, decay = _step_size(dt_ptr, A_ptr, dt_bias_ptr, b, h, s_dtb, s_dth, s_A, s_dtbias, lo, hi,
                               HAS_DT, HAS_A, HAS_DT_BIAS, SOFTPLUS, CLAMP)
        y = _state_step(state_ptr + offset64(b, s_sb) + h * s_sh, rows, cols, rmask, nmask, s_sp, s_sn, x, Bv, Cv,
                        dt, decay)
        y = y * scale
        if D_MODE != 0:
            y += _skip(D_ptr, h, rows, rmask, s_Dh, s_Dp, d_scalar, x, D_MODE)
        tl.store(y_ptr + offset64(b, s_yb) + h * P + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _roll_windows_kernel(xbc_ptr, cs_ptr, W, K, NCB, s_xb, s_csb, s_csc, s_csk,
                             BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
        """Launch 2: ``conv_state[b, c] <- [conv_state[b, c, 1:], xbc[b, c]]`` for one block of channels. The
        thread that stores tap j need not be the one that loaded it (tap j + 1 of the old window): the barrier
        between the loads and the stores keeps a store from overwriting a tap another thread has yet to read."""
        pid = tl.program_id(0)
        cb = pid % NCB
        b = pid // NCB
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < W
        cs_row = cs_ptr + offset64(b, s_csb)
        win = _window(cs_row, xbc_ptr + offset64(b, s_xb), c, cmask, K, s_csc, s_csk, cs_ptr.dtype.element_ty,
                      BLOCK_K)
        tl.debug_barrier()
        j = tl.arange(0, BLOCK_K)[None, :]
        tl.store(cs_row + c[:, None] * s_csc + j * s_csk, win, mask=cmask[:, None] & (j < K))


def _d_mode(D: Optional[Tensor], d_scalar: Optional[float]) -> int:
    """The skip's form for :func:`_skip`: 0 none, 1 a number, 2 per head, 3 per channel."""
    if D is None:
        return 0 if d_scalar is None else 1
    return 2 if D.dim() == 1 else 3


def _decode_step(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], state: Tensor,
                 dt: Optional[Tensor], A_log: Optional[Tensor], D: Optional[Tensor], d_scalar: Optional[float],
                 dt_bias: Optional[Tensor], dt_softplus: bool, dt_lo: float, dt_hi: float, scale: float, silu: bool,
                 c_first: bool) -> Tensor:
    """Both launches on checked arguments (:func:`..ssd_decode_step`'s shapes); returns y (batch, heads*head_dim)."""
    b, h, p, n = state.shape
    width, k = conv_weight.shape
    y = torch.empty(b, h * p, dtype=xbc.dtype, device=xbc.device)
    if b == 0:
        return y
    groups = (width - h * p) // (2 * n)
    b_off = h * p + (groups * n if c_first else 0)
    c_off = h * p + (0 if c_first else groups * n)
    clamp = dt_lo > 0.0 or dt_hi != math.inf
    d_mode = _d_mode(D, d_scalar)
    dummy = xbc  # the pointer passed for an absent tensor (never read: its flag is off)
    grid, blocks = step_layout(b, h, p, n, k)
    roll_grid, roll_blocks = roll_layout(b, width, k)
    with on_device(xbc.device):
        _decode_step_kernel[grid](
            xbc, conv_state, conv_weight, dummy if conv_bias is None else conv_bias, state,
            dummy if dt is None else dt, dummy if A_log is None else A_log, dummy if D is None else D,
            dummy if dt_bias is None else dt_bias, y,
            h, p, n, k, blocks.pop("NPB"), h // groups, b_off, c_off,
            xbc.stride(0), *conv_state.stride(), *conv_weight.stride(),
            0 if conv_bias is None else conv_bias.stride(0), *state.stride(),
            *((0, 0) if dt is None else dt.stride()), 0 if A_log is None else A_log.stride(0),
            *((0, 0) if D is None else (D.stride(0), D.stride(1) if D.dim() == 2 else 0)),
            0 if dt_bias is None else dt_bias.stride(0), y.stride(0),
            0.0 if d_scalar is None else float(d_scalar), float(dt_lo), float(dt_hi) if dt_hi != math.inf else 3.0e38,
            float(scale),
            HAS_BIAS=conv_bias is not None, SILU=bool(silu), HAS_DT=dt is not None, HAS_A=A_log is not None,
            HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), CLAMP=clamp, D_MODE=d_mode, **blocks)
        _roll_windows_kernel[roll_grid](
            xbc, conv_state, width, k, roll_blocks.pop("NCB"), xbc.stride(0), *conv_state.stride(), **roll_blocks)
    return y


# -- custom op: opaque to torch.compile (a fake kernel), mutating both states ---------------------------------

@torch.library.custom_op("mixer_plugins::ssd_decode_step_triton", mutates_args=("conv_state", "state"))
def _decode_op(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor], state: Tensor,
               dt: Optional[Tensor], A_log: Optional[Tensor], D: Optional[Tensor], d_scalar: Optional[float],
               dt_bias: Optional[Tensor], dt_softplus: bool, dt_lo: float, dt_hi: float, scale: float, silu: bool,
               c_first: bool) -> Tensor:
    """One fused decoding step; updates ``conv_state`` and ``state`` in place, returns y in xbc's dtype."""
    return _decode_step(xbc, conv_state, conv_weight, conv_bias, state, dt, A_log, D, d_scalar, dt_bias, dt_softplus,
                        dt_lo, dt_hi, scale, silu, c_first)


@_decode_op.register_fake
def _decode_op_fake(xbc, conv_state, conv_weight, conv_bias, state, dt, A_log, D, d_scalar, dt_bias, dt_softplus, dt_lo,
                    dt_hi, scale, silu, c_first):
    b, h, p, _ = state.shape
    return xbc.new_empty(b, h * p)


def ssd_decode_step_triton(xbc: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
                           state: Tensor, dt: Optional[Tensor], A_log: Optional[Tensor],
                           D: Tensor | float | None = None, *, bc_order: str = "BC", dt_bias: Optional[Tensor] = None,
                           dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
                           scale: float = 1.0, silu: bool = True) -> Tensor:
    """One decoding step as :func:`mixer_plugins.kernels.decode.ssd_decode_step` (arguments checked there; kernel at
    most :data:`MAX_TAPS` taps, d_state at most :data:`MAX_D_STATE`). Updates ``conv_state`` and ``state`` in place;
    returns y (batch, heads * head_dim) in xbc's dtype."""
    reason = available(xbc.device)
    if reason is not None:
        raise RuntimeError(f"triton ssd_decode_step unavailable: {reason}")
    d_tensor = D if isinstance(D, Tensor) else None
    d_scalar = None if D is None or d_tensor is not None else float(D)
    return _decode_op(xbc, conv_state, conv_weight, conv_bias, state, dt, A_log, d_tensor, d_scalar, dt_bias,
                      bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]), float(scale), bool(silu),
                      bc_order == "CB")
