"""Fused MLR (multi-level low-rank) attention forward in Triton: flash-style, no L x L tensor.

Scores (per head; see ``mixer_plugins.mixers.mlr_attention``)::

    S(i, j) = sum_l [i, j in the same level-l block] * tau_l * q_i^(l) . k_j^(l)     (/ cnt(i, j) with block_divide)

with level l's features a contiguous slice of the head dim (widths ``ranks``) and its blocks ``block_sizes[l]``
tokens aligned at 0 (None = global; the last, partial block is a block). Then the causal mask (optional), the
right-padding mask, softmax over the keys, and the values.

One program = one (query tile, batch * head); it walks the key tiles (only up to the diagonal when causal) with an
online softmax. For each (query tile, key tile) pair, only the levels the two tiles share are computed: a level whose
blocks put the two tiles apart is skipped, so far-apart tiles use only the coarse levels' features (the paper's
FLOP saving); a level with a block boundary inside the pair is masked per entry. Accumulation in float32.

Forward only (no backward yet). Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` set before import.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
from torch import Tensor

try:  # the ``triton`` package, not this module (absolute import)
    import triton
    import triton.language as tl
    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - triton is an optional extra
    triton = None
    tl = None
    _IMPORT_ERROR = f"triton is not importable ({exc})"

__all__ = ["available", "mlr_attention_triton"]

_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str | None = None) -> str | None:
    """Why the Triton MLR attention cannot run on ``device``, or None if it can."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if _INTERPRET_AT_IMPORT:
        return None if dev.type == "cpu" else "TRITON_INTERPRET=1 was set at import: the kernels run on CPU tensors only"
    if dev.type != "cuda" or not torch.cuda.is_available():
        return "the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import, to run them on CPU)"
    return None


if triton is not None:

    @triton.jit
    def _mlr_fwd_kernel(
        q_ptr, k_ptr, v_ptr, keyok_ptr, lvl_off_ptr, lvl_rank_ptr, lvl_size_ptr, y_ptr,
        L, H, E, P,
        NUM_LEVELS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_DIVIDE: tl.constexpr, HAS_KEYOK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid = tl.program_id(1)
        b = pid // H
        h = pid % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        m_ok = offs_m < L
        m_lo = pid_m * BLOCK_M
        m_hi = tl.minimum(m_lo + BLOCK_M, L) - 1
        row_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        n_end = L
        if CAUSAL:
            n_end = m_hi + 1
        n_lo = 0
        while n_lo < n_end:
            offs_n = n_lo + tl.arange(0, BLOCK_M)
            n_ok = offs_n < L
            n_hi = tl.minimum(n_lo + BLOCK_M, L) - 1
            S = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
            cnt = tl.zeros([BLOCK_M, BLOCK_M], dtype=tl.float32)
            for lv in tl.static_range(NUM_LEVELS):
                off = tl.load(lvl_off_ptr + lv)
                rank = tl.load(lvl_rank_ptr + lv)
                size = tl.load(lvl_size_ptr + lv)              # 0 = global
                span = tl.maximum(size, 1)
                # the tiles share this level somewhere iff their block ranges overlap
                shared = (size == 0) | ((m_lo // span <= n_hi // span) & (n_lo // span <= m_hi // span))
                if shared:
                    r_ok = offs_r < rank
                    ql = tl.load(q_ptr + ((b * L + offs_m[:, None]) * H + h) * E + off + offs_r[None, :],
                                 mask=m_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                    kl = tl.load(k_ptr + ((b * L + offs_n[:, None]) * H + h) * E + off + offs_r[None, :],
                                 mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                    dot = tl.dot(ql, tl.trans(kl), input_precision="ieee")
                    same = (size == 0) | ((offs_m[:, None] // span) == (offs_n[None, :] // span))
                    S += tl.where(same, dot, 0.0)
                    cnt += tl.where(same, 1.0, 0.0)
            if BLOCK_DIVIDE:
                S = S / tl.maximum(cnt, 1.0)
            allowed = m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
            if HAS_KEYOK:
                kok = tl.load(keyok_ptr + b * L + offs_n, mask=n_ok, other=0)
                allowed = allowed & (kok != 0)[None, :]
            S = tl.where(allowed, S, -1.0e30)
            new_max = tl.maximum(row_max, tl.max(S, 1))
            alpha = tl.exp(row_max - new_max)
            prob = tl.exp(S - new_max[:, None])
            prob = tl.where(allowed, prob, 0.0)
            row_sum = row_sum * alpha + tl.sum(prob, 1)
            v = tl.load(v_ptr + ((b * L + offs_n[:, None]) * H + h) * P + offs_p[None, :],
                        mask=n_ok[:, None] & (offs_p < P)[None, :], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(prob, v, input_precision="ieee")
            row_max = new_max
            n_lo += BLOCK_M
        out = acc / tl.maximum(row_sum, 1.0e-30)[:, None]
        tl.store(y_ptr + ((b * L + offs_m[:, None]) * H + h) * P + offs_p[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & (offs_p < P)[None, :])


def mlr_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, ranks: Sequence[int], block_sizes: Sequence[Optional[int]],
    level_scales: Sequence[float], *, block_divide: bool = True, causal: bool = False, mask: Tensor | None = None,
    tile_size: int = 64,
) -> Tensor:
    """MLR attention forward: ``softmax(S + masks) v`` without materializing ``S``.

    q, k (b, l, h, e) with ``sum(ranks) == e`` (level l = the next ``ranks[l]`` features); v (b, l, h, p);
    ``block_sizes[l]`` tokens per level-l block (None = global; blocks aligned at 0); ``level_scales[l]`` = tau_l
    (the mixer's ``level_scales``, already divided by the number of levels when ``divide_by_levels``);
    ``mask`` bool (b, l), True on real tokens (pad keys are excluded; a row with no real token keeps all keys, as
    ``attention_bias_mask``). Returns (b, l, h, p) in v's dtype (pad outputs are not zeroed: the mixer does that).
    Not differentiable yet (forward only).
    """
    reason = available(q.device)
    if reason is not None:
        raise RuntimeError(f"triton MLR attention unavailable: {reason}")
    b, L, H, E = q.shape
    P = v.shape[-1]
    if sum(ranks) != E or len(ranks) != len(block_sizes) or len(ranks) != len(level_scales):
        raise ValueError(f"ranks {list(ranks)} must sum to the q/k width {E} and match block_sizes/level_scales")
    # tau_l folded into the queries, feature by feature
    tau = torch.cat([torch.full((r,), float(s), dtype=torch.float32, device=q.device)
                     for r, s in zip(ranks, level_scales)])
    qs = (q.float() * tau).contiguous()
    offsets = [sum(ranks[:i]) for i in range(len(ranks))]
    dev = q.device
    lvl_off = torch.tensor(offsets, dtype=torch.int32, device=dev)
    lvl_rank = torch.tensor(list(ranks), dtype=torch.int32, device=dev)
    lvl_size = torch.tensor([0 if s is None else int(s) for s in block_sizes], dtype=torch.int32, device=dev)
    keyok = None
    if mask is not None:
        keyok = (mask | ~mask.any(dim=1, keepdim=True)).to(torch.int8).contiguous()
    y = torch.empty(b, L, H, P, dtype=v.dtype, device=dev)
    # tl.dot needs >= 16 on GPUs; the interpreter takes any size (tests use tiny tiles to cross many boundaries)
    floor = 1 if _INTERPRET_AT_IMPORT else 16
    block_m = max(floor, triton.next_power_of_2(min(int(tile_size), L)))
    grid = (triton.cdiv(L, block_m), b * H)
    _mlr_fwd_kernel[grid](
        qs, k.contiguous(), v.contiguous(), keyok if keyok is not None else qs, lvl_off, lvl_rank, lvl_size, y,
        L, H, E, P,
        NUM_LEVELS=len(ranks), CAUSAL=bool(causal), BLOCK_DIVIDE=bool(block_divide), HAS_KEYOK=keyok is not None,
        BLOCK_M=block_m, BLOCK_R=max(floor, triton.next_power_of_2(max(ranks))),
        BLOCK_P=max(floor, triton.next_power_of_2(P)))
    return y
