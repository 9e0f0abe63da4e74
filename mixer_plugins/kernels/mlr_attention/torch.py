"""Tiled MLR attention: flash-style, memory linear in the length, no ``L x L`` tensor.

Blocks nest (every block size divides the coarser one), so the levels a pair ``(i, j)`` shares are a prefix
``0..m`` of the level list, and its score is ``sum_{l <= m} tau_l q_i^(l) . k_j^(l) / c_m`` with ``c_m = m + 1``
under ``block_divide`` (else 1): one dot product of the first ``R_m = r_0 + ... + r_m`` features, one scale. The
pairs are therefore split into **groups that share a level**:

* group ``m`` (``0 <= m < n-1``): same level-``m`` block, different level-``m+1`` blocks. Inside each level-``m``
  block (the *parent*), each level-``m+1`` block (a *child*) attends to the children before it and, without the
  causal mask, after it: rectangles with no mask at all (causality only bites on the diagonal);
* the finest level ``n-1``: each block attends to itself (causal mask inside it);
* group ``-1`` when level 0 is not global: different level-0 blocks share no level and score 0.

Levels whose block covers the whole sequence (``None``, or a size >= L) are merged into one global "parent".
Every (query rectangle, key rectangle) of a group is a **task**, batched over the parents of the same shape (the
last, partial parent and the last, partial child are tasks of their own). On the flash engine the global parent
is cut dyadically (virtual levels of ``child * 2^k`` tokens, same width and scale), so a few large batched
rectangles cover its pairs. A task returns its softmax-normalized output and log-sum-exp; the tasks are merged per
query with log-sum-exp (as in flash attention's split-KV). Optionally (``leaf_max``, off by default) the levels
inside small blocks are computed together, block by block, as one *leaf* group.

Engines per task:

* ``flash``: PyTorch's fused CPU flash-attention op (``_scaled_dot_product_flash_attention_for_cpu``, which
  returns the log-sum-exp, and its backward). It needs equal q/k/v widths, so the group's keys keep their first
  ``R_m`` features and are zero beyond (queries and values are shared by all groups, at width
  ``max(head_dim, value width)``); FLOPs per pair are those of attention, but no ``L x L`` tensor exists and the
  backward is the fused one. The backward of a task uses the *final* output and log-sum-exp of the whole row, so
  each task's gradient is exactly its share of the full softmax's gradient (split-KV backward).
* ``matmul``: plain batched matmuls per task at the group's own width ``R_m`` (any device, any dtype); its scores
  exist one task at a time (``child x parent`` tokens), recomputed in the backward.

One :class:`torch.autograd.Function` runs all tasks; it saves only q, k, v, the output and the log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from .._dispatch import Backend, register

__all__ = ["MLRPlan", "Task", "mlr_attention_torch", "plan_tasks"]

_FLASH_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
#: blocks of at most this many tokens, with their finer levels, form one leaf group (see :func:`plan_tasks`). Off
#: (0) by default: on CPU the leaf's per-block matmuls and elementwise passes measured slower than one flash group
#: per level (L=4096, paper levels: leaf of 64 2.1-2.4 s against 1.3-1.5 s for the four groups it replaces).
LEAF_MAX = 0


@dataclasses.dataclass(frozen=True)
class Task:
    """Queries ``[q0, q0 + q_len)`` against keys ``[k0, k0 + k_len)`` inside each of ``count`` parents of ``plen``
    tokens starting at ``start`` (parent ``p`` covers ``[start + p * plen, start + (p + 1) * plen)``)."""

    start: int
    count: int
    plen: int
    q0: int
    q_len: int
    k0: int
    k_len: int
    causal: bool  # only for diagonal tasks (q range == k range): key <= query inside the task


@dataclasses.dataclass(frozen=True)
class Group:
    """Pairs sharing exactly levels ``0..level`` (``level == -1``: none): feature width and scale of their score."""

    level: int
    width: int
    scale: float
    tasks: tuple[Task, ...]
    #: a *leaf* group (not None) covers every pair inside the level-``level`` blocks, finer levels included, with
    #: matmuls on each block: per finer level ``l``, (first feature, end feature, block size).
    inner: Optional[tuple[tuple[int, int, int], ...]] = None


@dataclasses.dataclass(frozen=True)
class MLRPlan:
    length: int
    groups: tuple[Group, ...]
    block_divide: bool = True

    def pairs(self) -> int:
        """(query, key) pairs computed per (batch, head): the causal pairs or all ``L^2``."""
        return sum(t.count * t.q_len * (t.k_len + 1) // 2 if t.causal else t.count * t.q_len * t.k_len
                   for g in self.groups for t in g.tasks)

    def score_macs(self) -> int:
        """Multiply-adds of the scores at the groups' own widths, per (batch, head)."""
        return sum((t.count * t.q_len * (t.k_len + 1) // 2 if t.causal else t.count * t.q_len * t.k_len) * g.width
                   for g in self.groups for t in g.tasks)


def _segments(start: int, end: int, size: int) -> list[tuple[int, int, int]]:
    """``[start, end)`` as (start, count, length) runs: the full pieces of ``size`` and the partial last one."""
    full, rem = divmod(end - start, size)
    runs = []
    if full:
        runs.append((start, full, size))
    if rem:
        runs.append((start + full * size, 1, rem))
    return runs


def plan_tasks(length: int, ranks: Sequence[int], block_sizes: Sequence[Optional[int]], *, causal: bool,
               block_divide: bool, dyadic: bool = True, leaf_max: int = LEAF_MAX) -> MLRPlan:
    """The groups and tasks that cover every allowed (query, key) pair of a length-``length`` sequence once.

    ``dyadic``: cover the global parent with a few large rectangles (halving virtual levels) instead of one query
    tile per child (the flash engine never materializes a rectangle's scores; the matmul engine does, so it keeps
    rectangles of ``child x length``). Levels inside blocks of at most ``leaf_max`` tokens are computed together,
    block by block (a leaf group), instead of one group per level: their blocks are too small to repay a group."""
    sizes = [None if s is None or s >= length else int(s) for s in block_sizes]
    n = len(sizes)
    num_global = next((i for i, s in enumerate(sizes) if s is not None), n)
    widths = [sum(ranks[: m + 1]) for m in range(n)]

    def divisor(m: int) -> float:
        return 1.0 / (m + 1) if block_divide and m >= 0 else 1.0

    def child_tasks(parents, child):
        tasks = []
        for start, count, plen in parents:
            for a in range(math.ceil(plen / child)):
                q0 = a * child
                q_len = min(child, plen - q0)
                if q0 > 0:
                    tasks.append(Task(start, count, plen, q0, q_len, 0, q0, False))
                after = plen - q0 - q_len
                if not causal and after > 0:
                    tasks.append(Task(start, count, plen, q0, q_len, q0 + q_len, after, False))
        return tasks

    leaf = next((j for j in range(num_global, n - 1) if sizes[j] <= leaf_max), None)
    groups = []
    # group m: parents at level m (the whole sequence for m = num_global - 1), children at level m + 1
    for m in range(num_global - 1, n - 1 if leaf is None else leaf):
        child = sizes[m + 1]
        if m < num_global and dyadic:
            # One parent, the whole sequence, with many children: split it dyadically instead (virtual levels of
            # child * 2^k tokens, same width and scale), so a few large batched rectangles cover its pairs.
            chain = [length]
            while chain[-1] > 2 * child:
                chain.append(child * 2 ** math.ceil(math.log2(chain[-1] / child) - 1))
            chain.append(child)
            tasks = []
            for parent, sub in zip(chain[:-1], chain[1:]):
                tasks += child_tasks(_segments(0, length, parent), sub)
        else:
            parents = [(0, 1, length)] if m < num_global else _segments(0, length, sizes[m])
            tasks = child_tasks(parents, child)
        groups.append(Group(m, widths[m] if m >= 0 else 0, divisor(m), tuple(tasks)))
    if leaf is not None:
        inner = tuple((widths[l - 1], widths[l], sizes[l]) for l in range(leaf + 1, n))
        groups.append(Group(leaf, widths[leaf], divisor(leaf), tuple(
            Task(s, c, p, 0, p, 0, p, causal) for s, c, p in _segments(0, length, sizes[leaf])), inner))
        return MLRPlan(length, tuple(g for g in groups if g.tasks), block_divide)
    finest = sizes[-1]
    diag = [(0, 1, length)] if finest is None else _segments(0, length, finest)
    groups.append(Group(n - 1, widths[-1], divisor(n - 1),
                        tuple(Task(s, c, p, 0, p, 0, p, causal) for s, c, p in diag)))
    return MLRPlan(length, tuple(g for g in groups if g.tasks), block_divide)


# -- engines: one task's (output, log-sum-exp) and its backward given the row's final output and log-sum-exp -------

def _flash_forward(q, k, v, causal, bias, scale):
    out, lse = _FLASH_FWD(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, bias, scale):
    return _FLASH_BWD(dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


def _scores(q, k, causal, bias, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _matmul_forward(q, k, v, causal, bias, scale):
    s = _scores(q, k, causal, bias, scale)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros((), dtype=lse.dtype, device=lse.device), lse)
    out = torch.matmul(torch.exp(s - safe[..., None]), v)
    return out, lse


def _matmul_backward(dout, q, k, v, out, lse, causal, bias, scale):
    p = torch.exp(_scores(q, k, causal, bias, scale) - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk, dv


def _flash_usable(q: Tensor, engine: str) -> bool:
    """Run on the flash engine? (``auto``: whenever PyTorch's CPU flash op can take ``q``)."""
    usable = _FLASH_FWD is not None and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES
    if engine == "flash":
        if not usable:
            raise ValueError(f"the flash engine needs PyTorch's CPU flash-attention op and a CPU tensor of dtype "
                             f"{', '.join(map(str, _FLASH_DTYPES))}; got {q.device.type} {q.dtype}")
        return True
    if engine not in ("auto", "matmul"):
        raise ValueError(f"engine must be 'auto', 'flash' or 'matmul', got {engine!r}")
    return usable and engine == "auto"


# -- the leaf group: every pair inside small blocks, all their levels, with matmuls on each block -----------------

@functools.lru_cache(maxsize=64)
def _leaf_constants(n: int, level: int, sizes: tuple[int, ...], block_divide: bool) -> tuple[Tensor, Tensor]:
    """(n, n) float64 scale of each pair (``1 / number of shared levels`` or 1) and (levels, n, n) same-block masks
    of the finer levels, for a block of ``n`` tokens aligned with every finer block."""
    pos = torch.arange(n)
    same = torch.stack([(pos[:, None] // s == pos[None, :] // s) for s in sizes]).double() if sizes else \
        torch.zeros(0, n, n, dtype=torch.float64)
    counts = level + 1 + same.sum(0)
    scale = 1.0 / counts if block_divide else torch.ones(n, n, dtype=torch.float64)
    return scale, same


def _leaf_parts(q, k, group: Group, block_divide: bool):
    n = q.shape[-2]
    scale, same = _leaf_constants(n, group.level, tuple(s for _, _, s in group.inner), block_divide)
    return scale.to(q.device, q.dtype), same.to(q.device, q.dtype)


def _leaf_scores(q, k, bias, group: Group, task: Task, scale, same):
    s = torch.matmul(q[..., : group.width], k[..., : group.width].transpose(-1, -2))
    for (c0, c1, _), m in zip(group.inner, same):
        s = s + m * torch.matmul(q[..., c0:c1], k[..., c0:c1].transpose(-1, -2))
    s = s * scale
    if bias is not None:
        s = s + bias
    if task.causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _leaf_forward(q, k, v, bias, group: Group, task: Task, *, block_divide: bool):
    scale, same = _leaf_parts(q, k, group, block_divide)
    s = _leaf_scores(q, k, bias, group, task, scale, same)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros((), dtype=lse.dtype, device=lse.device), lse)
    return torch.matmul(torch.exp(s - safe[..., None]), v), lse


def _leaf_backward(dout, q, k, v, out, lse, bias, group: Group, task: Task, *, block_divide: bool):
    scale, same = _leaf_parts(q, k, group, block_divide)
    p = torch.exp(_leaf_scores(q, k, bias, group, task, scale, same) - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    delta = (dout * out).sum(-1, keepdim=True)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta) * scale
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    w = group.width
    dq[..., :w] = torch.matmul(ds, k[..., :w])
    dk[..., :w] = torch.matmul(ds.transpose(-1, -2), q[..., :w])
    for (c0, c1, _), m in zip(group.inner, same):
        dsl = ds * m
        dq[..., c0:c1] = torch.matmul(dsl, k[..., c0:c1])
        dk[..., c0:c1] = torch.matmul(dsl.transpose(-1, -2), q[..., c0:c1])
    return dq, dk, dv


# -- the autograd Function -------------------------------------------------------------------------------------------

def _parents(t: Tensor, task: Task) -> Tensor:
    """(B, L, ...) -> (B, count, plen, ...) view of the task's parents."""
    return t[:, task.start: task.start + task.count * task.plen].unflatten(1, (task.count, task.plen))


def _kernel_layout(t: Tensor) -> Tensor:
    """(B, count, n, H, W) -> (B * count, H, n, W) (a copy only when B * count cannot be merged as a view)."""
    return t.flatten(0, 1).transpose(1, 2)


class _TiledMLR(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_real, plan, flash):
        # q (B, L, H, Dh) (level scales applied), k (B, L, H, Dh), v (B, L, H, P); key_real bool (B, L) or None;
        # flash: per group, whether it runs on the flash engine
        batch, length, heads, dh = q.shape
        pv = v.shape[-1]
        width = max(dh, pv) if any(flash) else None
        qw, vw = (_pad(q, width), _pad(v, width)) if width else (q, v)
        bias = None
        if key_real is not None:
            bias = torch.zeros(batch, length, dtype=q.dtype, device=q.device).masked_fill(~key_real, float("-inf"))
        out = torch.zeros(batch, length, heads, vw.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full((batch, length, heads), float("-inf"), dtype=_lse_dtype(q.dtype), device=q.device)
        keys = []  # each group's keys, kept for the backward (flash: a zero-padded copy per group)
        for group, use_flash in zip(plan.groups, flash):
            if group.inner is not None:
                qg, kg = q, k
            else:
                qg, kg = _group_qk(qw, k, group, width if use_flash else None)
            keys.append(kg)
            for task in group.tasks:
                args = _task_inputs(qg, kg, vw, bias, task)
                if group.inner is not None:
                    o, l = _leaf_forward(*args, group, task, block_divide=plan.block_divide)
                else:
                    o, l = (_flash_forward if use_flash else _matmul_forward)(*args[:3], task.causal, args[3],
                                                                              group.scale)
                if key_real is not None:  # rows whose task keys are all pads (right padding: the first key is)
                    empty = ~_parents(key_real, task)[:, :, task.k0].flatten()
                    l = l.masked_fill(empty[:, None, None], float("-inf"))
                _merge(_parents(out, task)[:, :, task.q0: task.q0 + task.q_len],
                       _parents(lse, task)[:, :, task.q0: task.q0 + task.q_len],
                       o.transpose(1, 2).unflatten(0, (batch, task.count)),
                       l.transpose(1, 2).unflatten(0, (batch, task.count)).to(lse.dtype))
        ctx.save_for_backward(q, k, v, key_real, out, lse)
        ctx.plan, ctx.flash, ctx.keys = plan, flash, keys
        return out[..., :pv].contiguous() if out.shape[-1] != pv else out.clone()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, key_real, out, lse = ctx.saved_tensors
        plan, flash = ctx.plan, ctx.flash
        batch, length, heads, dh = q.shape
        pv = v.shape[-1]
        width = max(dh, pv) if any(flash) else None
        qw, vw = (_pad(q, width), _pad(v, width)) if width else (q, v)
        dout = dout.contiguous()
        if dout.shape[-1] != out.shape[-1]:
            dout = _pad(dout, out.shape[-1])
        bias = None
        if key_real is not None:
            bias = torch.zeros(batch, length, dtype=q.dtype, device=q.device).masked_fill(~key_real, float("-inf"))
        dq = torch.zeros_like(qw)
        dk = torch.zeros(batch, length, heads, qw.shape[-1], dtype=q.dtype, device=q.device)
        dv = torch.zeros_like(vw)
        for group, use_flash, kg in zip(plan.groups, flash, ctx.keys):
            leaf = group.inner is not None
            qg = q if leaf else qw if use_flash else qw[..., : group.width]
            gw = qg.shape[-1]
            kw = kg.shape[-1] if leaf else group.width
            for task in group.tasks:
                qt, kt, vt, bt = _task_inputs(qg, kg, vw, bias, task)
                rows = slice(task.q0, task.q0 + task.q_len)
                do_t = _kernel_layout(_parents(dout, task)[:, :, rows])
                o_t = _kernel_layout(_parents(out, task)[:, :, rows])
                l_t = _parents(lse, task)[:, :, rows].flatten(0, 1).transpose(1, 2).contiguous()
                if not use_flash:
                    l_t = l_t.to(q.dtype)
                if leaf:
                    gq, gk, gv = _leaf_backward(do_t, qt, kt, vt, o_t, l_t.to(q.dtype), bt, group, task,
                                                block_divide=plan.block_divide)
                else:
                    gq, gk, gv = (_flash_backward if use_flash else _matmul_backward)(
                        do_t, qt, kt, vt, o_t, l_t, task.causal, bt, group.scale)
                keys = slice(task.k0, task.k0 + task.k_len)
                unflat = (batch, task.count)
                _parents(dq, task)[:, :, rows, :, :gw] += gq.transpose(1, 2).unflatten(0, unflat)
                _parents(dk, task)[:, :, keys, :, :kw] += gk.transpose(1, 2).unflatten(0, unflat)[..., :kw]
                _parents(dv, task)[:, :, keys] += gv.transpose(1, 2).unflatten(0, unflat)
        return dq[..., :dh], dk[..., :dh], dv[..., :pv], None, None, None


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pad(t: Tensor, width: int) -> Tensor:
    if t.shape[-1] == width:
        return t.contiguous()
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _group_qk(qw: Tensor, k: Tensor, group: Group, width: int | None) -> tuple[Tensor, Tensor]:
    """The group's queries and keys: the first ``group.width`` features (flash: keys zero beyond, full width)."""
    if width is None:
        return qw[..., : group.width], k[..., : group.width]
    kg = torch.nn.functional.pad(k[..., : group.width], (0, width - group.width))
    return qw, kg


def _task_inputs(qg, kg, vw, bias, task: Task):
    rows = slice(task.q0, task.q0 + task.q_len)
    keys = slice(task.k0, task.k0 + task.k_len)
    qt = _kernel_layout(_parents(qg, task)[:, :, rows])
    kt = _kernel_layout(_parents(kg, task)[:, :, keys])
    vt = _kernel_layout(_parents(vw, task)[:, :, keys])
    bt = None
    if bias is not None:
        bt = _parents(bias, task)[:, :, keys].flatten(0, 1)[:, None, None, :]
    return qt, kt, vt, bt


def _merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold a task's normalized ``out`` (.., H, W) and ``lse`` (.., H) into the running ones, in place.

    Both are normalized, so the merged output is ``acc + w (out - acc)`` with ``w = exp(lse - logaddexp(acc_lse,
    lse))``: one pass (``lerp``). Rows where both are ``-inf`` (no allowed key yet) keep ``w = 0``."""
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new), torch.zeros((), dtype=new.dtype, device=new.device), new)
    take = torch.exp(lse - safe).to(acc_out.dtype)[..., None]
    acc_out.lerp_(out, take)
    acc_lse.copy_(new)


def mlr_attention_torch(q: Tensor, k: Tensor, v: Tensor, *, ranks: Sequence[int],
                        block_sizes: Sequence[Optional[int]], scales: Sequence[float], causal: bool = False,
                        mask: Tensor | None = None, block_divide: bool = True, engine: str = "auto",
                        leaf_max: int = LEAF_MAX) -> Tensor:
    """The tiled fast path (see the module docstring); arguments as :func:`mixer_plugins.kernels.mlr_attention`.

    ``engine``: ``"auto"`` (the fused CPU flash op on CPU, else matmuls), ``"flash"`` or ``"matmul"``;
    ``leaf_max``: blocks of at most this many tokens are computed with all their finer levels at once (0: never).
    """
    length = q.shape[1]
    key_real = None
    if mask is not None:
        real = mask[:, :, None, None]
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        q, k, v = (torch.where(real, t, zero) for t in (q, k, v))  # select: NaN in pads never propagates
        key_real = mask | ~mask.any(dim=1, keepdim=True)  # a row with no real token keeps every key
    feature_scale = torch.cat([torch.full((r,), float(s), dtype=q.dtype, device=q.device)
                               for r, s in zip(ranks, scales)])
    q = q * feature_scale
    flash = _flash_usable(q, engine)
    plan = plan_tasks(length, ranks, block_sizes, causal=causal, block_divide=block_divide, dyadic=flash,
                      leaf_max=leaf_max)
    out = _TiledMLR.apply(q, k, v, key_real, plan, (flash,) * len(plan.groups))
    if mask is not None:
        out = torch.where(mask[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


impl = mlr_attention_torch  # the backend entry point, as in every op folder
BACKEND = register(Backend(op="mlr_attention", name="torch", impl=impl, priority=10))
