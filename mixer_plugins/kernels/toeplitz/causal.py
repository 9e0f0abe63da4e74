"""The causal Toeplitz product ``y_i = sum_{d=0}^{i} c_d v_{i-d}``, arranged so that the past never sees the future.

One FFT over the whole sequence spreads the round-off of every input over every output: a huge (finite) future
token then changes past outputs, or overflows the spectrum and turns them NaN. Here every product is either a
direct one (each output its own dot product) or an FFT whose inputs all come before its first output, so an
output depends, even through round-off, only on taps ``c_d`` and values ``v_j`` with ``d, j <= i``. Both operands
may come from the tokens (data-dependent taps: token d makes ``c_d``).

Pairs of offsets ``(d, j)`` are grouped in tiles of ``T`` positions, ``(D, J) = (d // T, j // T)``:

* ``D = 0`` or ``J = 0``: direct products by small Toeplitz matmuls (the diagonal tile lower-triangular).
* ``D, J >= 1``: a square of ``S x S`` tile pairs starting at ``(D0, J0)`` has inputs up to ``(D0 + S) T - 1`` and
  ``(J0 + S) T - 1`` and outputs from ``(D0 + J0) T``: safe for one FFT when ``S <= D0`` and ``S <= J0``. Each pair
  goes to the largest safe dyadic square: at level ``P = S T`` (S = 1, 2, 4, ...) the taps ``[P, 2P)`` against the
  value blocks ``[bP, bP + P)``, b >= 1, and the values ``[P, 2P)`` against the tap blocks ``[aP, aP + P)``, a >= 2.
  A level is one batched FFT of size 2P over all its blocks, added in overlap.

Cost: O(L log^2 L) (log2(L/T) levels of FFTs over about 4L points) plus O(L T) direct work; exact in float64
against the matrix. :func:`toeplitz_causal_flops` counts exactly what runs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CAUSAL_TILE", "causal_toeplitz", "toeplitz_causal_flops"]

CAUSAL_TILE = 64
"""Tile of the direct products (positions). Changes speed only, never which inputs an output sees."""


def _plan(length: int, tile: int) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(tile, padded length N, levels [(P, blocks of values, blocks of taps)]) for a sequence of ``length``."""
    t = max(1, min(tile, length))
    n = t * math.ceil(length / t)
    levels = []
    p = t
    while 2 * p < n:
        nb = math.ceil(n / p)
        levels.append((p, nb - 2, max(0, nb - 3)))
        p *= 2
    return t, n, levels


def _tile_product(matrices: Tensor, tiles: Tensor) -> Tensor:
    """(bt, h, [m,] T, T) matrices times (b, h, p, [m,] T) tiles -> (b, h, p, m, T); bt is 1 or b."""
    shared = matrices.shape[0] == 1 and tiles.shape[0] != 1
    m = "m" if matrices.dim() == 5 else ""
    lhs = ("h" if shared else "bh") + m + "rq"
    rhs = "bhp" + ("m" if tiles.dim() == 5 else "") + "q"
    return torch.einsum(f"{lhs},{rhs}->bhpmr", matrices[0] if shared else matrices, tiles)


def _direct(k: Tensor, x: Tensor, t: int) -> Tensor:
    """Pairs with d < T or j < T: k (bt, h, N) taps, x (b, h, p, N) values -> (b, h, p, N)."""
    b, h, p, n = x.shape
    m = n // t
    r = torch.arange(t, device=x.device)
    diff = r[:, None] - r[None, :]                                    # r - q
    zero = k.new_zeros(())
    lower = torch.where(diff >= 0, k[..., diff.clamp(min=0)], zero)   # d = r - q in [0, T)
    upper = torch.where(diff < 0, k[..., (t + diff).clamp(max=t - 1)], zero)  # d = T + r - q in [1, T)
    tiles = x.reshape(b, h, p, m, t)
    previous = F.pad(tiles, (0, 0, 1, 0))[..., :m, :]                 # tile I - 1 (zeros before the first)
    y = _tile_product(lower, tiles) + _tile_product(upper, previous)
    if m > 1:
        # output tile I >= 1 from value tile 0 with d >= T: C_I[r, q] = k[I T + r - q] (tile 1: only r >= q)
        index = torch.arange(1, m, device=x.device)[:, None, None] * t + diff      # (m-1, T, T), within [1, N)
        first = torch.where((index >= t), k[..., index], zero)
        y[..., 1:, :] += _tile_product(first, tiles[..., 0, :])
    return y.reshape(b, h, p, n)


def _level(k: Tensor, x: Tensor, y: Tensor, p_len: int, value_blocks: int, tap_blocks: int) -> None:
    """Adds the tile pairs of one dyadic level ``P`` into ``y`` (b, h, p, >= N + 2P), in place."""
    b, h, p, _ = x.shape
    size = 2 * p_len
    rfft = torch.fft.rfft
    # taps [P, 2P) against the value blocks a = 1 .. value_blocks (outputs from (a + 1) P)
    values = x[..., p_len: (value_blocks + 1) * p_len].reshape(b, h, p, value_blocks, p_len)
    spectrum = rfft(values, n=size)
    spectrum *= rfft(k[..., p_len: size], n=size)[:, :, None, None]
    if tap_blocks > 0:
        # the values [P, 2P) against the tap blocks a = 2 .. tap_blocks + 1 (outputs from (a + 1) P)
        taps = k[..., size: (tap_blocks + 2) * p_len].reshape(k.shape[0], h, 1, tap_blocks, p_len)
        spectrum[..., 1:, :] += rfft(taps, n=size) * rfft(x[..., p_len: size], n=size)[..., None, :]
    out = torch.fft.irfft(spectrum, n=size)                               # (b, h, p, blocks, 2P)
    first = y[..., 2 * p_len: (value_blocks + 2) * p_len].view(b, h, p, value_blocks, p_len)
    first += out[..., :p_len]
    second = y[..., 3 * p_len: (value_blocks + 3) * p_len].view(b, h, p, value_blocks, p_len)
    second += out[..., p_len:]


def causal_toeplitz(taps: Tensor, v: Tensor, *, tile: int = CAUSAL_TILE) -> Tensor:
    """``y_i = sum_{d <= i} taps[d] v_{i-d}`` per head: taps (b|1, h, L) (offsets 0 .. L-1), v (b, L, h, p).

    Output i depends only on taps and values at positions ``<= i``, round-off included (see the module)."""
    b, length, h, p = v.shape
    if b == 0 or length == 0:
        return v.new_zeros(v.shape)
    compute = torch.float32 if v.dtype in (torch.float16, torch.bfloat16) else v.dtype
    t, n, levels = _plan(length, tile)
    x = F.pad(v.to(compute).permute(0, 2, 3, 1), (0, n - length))         # (b, h, p, N)
    k = F.pad(taps.to(compute), (0, n - length))                            # (bt, h, N)
    y = _direct(k, x, t)
    if levels:
        y = F.pad(y, (0, 2 * levels[-1][0]))                                    # room for the last blocks' tails
        for p_len, value_blocks, tap_blocks in levels:
            _level(k, x, y, p_len, value_blocks, tap_blocks)
    return y[..., :length].permute(0, 3, 1, 2).to(v.dtype).contiguous()


def _fft_flops(size: int) -> int:
    return int(2.5 * size * math.log2(size))


def toeplitz_causal_flops(batch: int, length: int, heads: int, head_dim: int, tap_batch: int | None = None,
                          *, tile: int = CAUSAL_TILE) -> int:
    """FLOPs of :func:`causal_toeplitz` as it runs: the direct matmuls (2 per multiply-add, zeros of the
    triangular tiles included), then per level ``2.5 n log2 n`` per real FFT of size ``n = 2P``, 6 per complex
    multiply and 2 per complex add of the spectra (the convention of :func:`toeplitz_fft_flops`)."""
    if batch == 0 or length == 0:
        return 0
    tap_batch = batch if tap_batch is None else tap_batch
    channels = batch * heads * head_dim
    t, n, levels = _plan(length, tile)
    m = n // t
    total = 2 * channels * t * t * (2 * m + (m - 1))
    for p_len, value_blocks, tap_blocks in levels:
        size = 2 * p_len
        bins = p_len + 1
        fft = _fft_flops(size)
        total += tap_batch * heads * fft + channels * value_blocks * fft + 6 * channels * value_blocks * bins
        if tap_blocks > 0:
            total += tap_batch * heads * tap_blocks * fft + channels * fft
            total += 6 * channels * tap_blocks * bins + 2 * channels * tap_blocks * bins
        total += channels * value_blocks * fft                                  # the inverse FFTs
    return total
