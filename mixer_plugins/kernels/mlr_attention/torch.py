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
last, partial parent and the last, partial child are tasks of their own). The global parent is cut dyadically
(virtual levels of ``child * 2^k`` tokens, same width and scale), so a few large batched rectangles cover its pairs.
A task returns its softmax-normalized output and log-sum-exp; the tasks are merged per query with log-sum-exp (as in
flash attention's split-KV). The backward of a task uses the *final* output and log-sum-exp of the whole row, so
each task's gradient is exactly its share of the full softmax's gradient (split-KV backward). Optionally
(``leaf_max``, off by default, eager only) the levels inside small blocks are computed together, block by block, as
one *leaf* group.

Engines (``engine=``; ``"auto"``: :data:`AUTO_ENGINE` where it can run, else the next of ``native``, ``flash``,
``matmul`` that can):

* ``native`` (the CPU default for float32 and float64): our fused C++ kernel (:mod:`.native`, compiled on first
  use): for each query tile, key ranges whose pairs share the same levels, each at its own width ``R_m`` with one
  BLAS product for its scores and one for its values, online softmax, no Python per range; near the diagonal the
  finer levels per entry; the backward recomputes the scores. q, k, v read in place (no copies), the level scales
  applied inside. Right padding only (keys beyond each row's length are skipped).
* ``flash``: PyTorch's fused CPU flash-attention op
  (``_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp, and its backward). It needs equal
  q/k/v widths, so the group's keys keep their first ``R_m`` features and are zero beyond (queries and values are
  shared by all groups, at width ``max(head_dim, value width)``): it executes attention's FLOPs per pair, more than
  the count (see :func:`mixer_plugins.kernels.mlr_attention.mlr_attention_flops`).
* ``matmul``: :mod:`.chunked`, batched matmuls per task at the group's own width ``R_m`` (any device, any dtype), rows
  in chunks whose scores fit one reused scratch buffer; no padding.

All three run inside one ``torch.library`` custom op (:func:`mlr_attention_tiled`, with its backward op), so
``torch.compile`` sees one node and ``FlopCounterMode`` counts it by its registered formula (the paper's count,
:func:`paper_flops`). It saves only q, k, v, the output and the log-sum-exp.

Under ``torch.export`` (and so ``torch.onnx.export(..., dynamo=True)``) the materialized formula of
:mod:`.reference` is traced instead (standard ops only, ``O(L^2)`` memory like plain attention), so an exported graph
runs without this library and translates to ONNX.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .. import _native as _native_lib
from .._dispatch import Backend, register
from .._library import save_tensors, saved_tensors
from . import native
from .chunked import chunked_backward, chunked_forward
from .plan import LEAF_MAX, Group, MLRPlan, Task, plan_tasks  # noqa: F401  (re-exported)
from .reference import mlr_attention_reference

__all__ = ["AUTO_ENGINE", "ENGINES", "MLRPlan", "Task", "mlr_attention_tiled", "mlr_attention_torch", "paper_flops",
           "plan_tasks"]

_FLASH_FWD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
#: the engine ``engine="auto"`` prefers where it can run (measured, see docs/structured_attention.md); the others
#: follow in the order of :data:`ENGINES`
AUTO_ENGINE = "native"
#: every engine, fastest first (on CPU)
ENGINES = ("native", "flash", "matmul")

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


def _native_usable(q: Tensor) -> bool:
    """Can the native engine take ``q``? (Under ``torch.compile`` only if already loaded: tracing never builds.)"""
    if torch.compiler.is_compiling():
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and native.is_loaded()
    return _native_lib.takes(q)


def _flash_possible(q: Tensor) -> bool:
    return _FLASH_FWD is not None and q.device.type == "cpu" and q.dtype in _FLASH_DTYPES


def _engine(q: Tensor, engine: str) -> str:
    """The engine that runs for ``q``: the one asked for (an error if it cannot run), or for ``"auto"``
    :data:`AUTO_ENGINE` where it can run, else the first of :data:`ENGINES` after it that can."""
    if engine not in ("auto", *ENGINES):
        raise ValueError(f"engine must be 'auto', {', '.join(repr(e) for e in ENGINES)}; got {engine!r}")
    if engine == "native":
        if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the native engine takes float32 or float64 CPU tensors; got {q.device.type} {q.dtype}")
        if not native.load():
            raise RuntimeError(f"the native MLR engine is unavailable: {native.unavailable_reason()}")
        return "native"
    if engine == "flash":
        if not _flash_possible(q):
            raise ValueError(f"the flash engine needs PyTorch's CPU flash-attention op and a CPU tensor of dtype "
                             f"{', '.join(map(str, _FLASH_DTYPES))}; got {q.device.type} {q.dtype}")
        return "flash"
    if engine == "matmul":
        return "matmul"
    usable = {"native": _native_usable, "flash": _flash_possible, "matmul": lambda _: True}
    order = ENGINES[ENGINES.index(AUTO_ENGINE):] if AUTO_ENGINE in ENGINES else ENGINES
    return next(e for e in order if usable[e](q))


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


def _inner(group: Group) -> tuple[tuple[int, int, int], ...]:
    """A leaf group's finer levels (first feature, end feature, block size)."""
    assert group.inner is not None, "not a leaf group"
    return group.inner


def _leaf_parts(q, k, group: Group, block_divide: bool):
    n = q.shape[-2]
    scale, same = _leaf_constants(n, group.level, tuple(s for _, _, s in _inner(group)), block_divide)
    return scale.to(q.device, q.dtype), same.to(q.device, q.dtype)


def _leaf_scores(q, k, bias, group: Group, task: Task, scale, same):
    s = torch.matmul(q[..., : group.width], k[..., : group.width].transpose(-1, -2))
    for (c0, c1, _), m in zip(_inner(group), same):
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
    for (c0, c1, _), m in zip(_inner(group), same):
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


def _tiled_forward(q: Tensor, k: Tensor, v: Tensor, key_real: Tensor | None, plan: MLRPlan,
                   flash: tuple[bool, ...]) -> tuple[Tensor, Tensor]:
    """Per-task engines (flash, per-task matmul, leaf): output at the padded value width, log-sum-exp (B, L, H),
    for :func:`_tiled_backward`.

    q (B, L, H, Dh) (level scales applied), k (B, L, H, Dh), v (B, L, H, P); key_real bool (B, L) or None; flash:
    per group, whether it runs on the flash engine."""
    batch, length, heads, dh = q.shape
    pv = v.shape[-1]
    width = max(dh, pv) if any(flash) else None
    qw, vw = (_pad(q, width), _pad(v, width)) if width else (q, v)
    bias = None
    if key_real is not None:
        bias = torch.zeros(batch, length, dtype=q.dtype, device=q.device).masked_fill(~key_real, float("-inf"))
    out = torch.zeros(batch, length, heads, vw.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((batch, length, heads), float("-inf"), dtype=_lse_dtype(q.dtype), device=q.device)
    for group, use_flash in zip(plan.groups, flash):
        kg = _group_key(k, group, use_flash, width)  # one group at a time: the allocator reuses its buffer
        qg = q if group.inner is not None else qw if use_flash else qw[..., : group.width]
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
    return out, lse


def _tiled_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, key_real: Tensor | None, out: Tensor, lse: Tensor,
                    plan: MLRPlan, flash: tuple[bool, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`_tiled_forward` given its (padded) output and log-sum-exp."""
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
    for group, use_flash in zip(plan.groups, flash):
        kg = _group_key(k, group, use_flash, width)
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
    return dq[..., :dh], dk[..., :dh], dv[..., :pv]


def _group_key(k: Tensor, group: Group, use_flash: bool, width: int | None) -> Tensor:
    """A group's keys: all of them (leaf), the first ``R_m`` features (matmul), or those zero-padded to ``width``
    (flash: the kernel's one width; a copy per group, made when the group runs so that its buffer is reused)."""
    if group.inner is not None:
        return k
    if not use_flash:
        return k[..., : group.width]
    assert width is not None, "the flash engine's keys are padded to one width"
    return torch.nn.functional.pad(k[..., : group.width], (0, width - group.width))


class _TiledMLR(torch.autograd.Function):
    """Autograd of :func:`_tiled_forward` (the leaf plans; the others run as the custom op below)."""

    @staticmethod
    def forward(ctx, q, k, v, key_real, plan, flash):
        out, lse = _tiled_forward(q, k, v, key_real, plan, flash)
        ctx.save_for_backward(q, k, v, key_real, out, lse)
        ctx.plan, ctx.flash = plan, flash
        pv = v.shape[-1]
        return out[..., :pv].contiguous() if out.shape[-1] != pv else out.clone()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, key_real, out, lse = ctx.saved_tensors
        return (*_tiled_backward(dout, q, k, v, key_real, out, lse, ctx.plan, ctx.flash), None, None, None)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pad(t: Tensor, width: int) -> Tensor:
    if t.shape[-1] == width:
        return t.contiguous()
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _task_inputs(qg: Tensor, kg: Tensor, vw: Tensor, bias: Tensor | None,
                 task: Task) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
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


# -- the custom op: what torch.compile, torch.export and FlopCounterMode see --------------------------------------

def _sizes_arg(block_sizes: Sequence[Optional[int]]) -> list[int]:
    return [0 if s is None else int(s) for s in block_sizes]  # the op schema has no optional ints in lists: 0 = None


def _plan(length: int, ranks: Sequence[int], sizes: Sequence[int], causal: bool, block_divide: bool) -> MLRPlan:
    return _cached_plan(length, tuple(ranks), tuple(None if s == 0 else s for s in sizes), causal, block_divide)


@functools.lru_cache(maxsize=256)
def _cached_plan(length, ranks, sizes, causal, block_divide) -> MLRPlan:
    return plan_tasks(length, ranks, sizes, causal=causal, block_divide=block_divide, dyadic=True)


def _head_major(t: Tensor) -> Tensor:
    return t.transpose(1, 2).contiguous()


def _key_lengths(key_real: Tensor | None) -> Tensor | None:
    """Per row, the number of real keys of a right-padded ``key_real`` (B, L) (the native engine's form)."""
    if key_real is None:
        return None
    lengths = key_real.sum(dim=1)
    if not torch.equal(key_real, torch.arange(key_real.shape[1], device=key_real.device)[None, :] < lengths[:, None]):
        raise ValueError("the native MLR engine takes right-padded key masks only (real keys first)")
    return lengths.to(torch.int64)


def _key_bias(key_real: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if key_real is None:
        return None
    return torch.zeros(key_real.shape, dtype=dtype, device=key_real.device).masked_fill(~key_real, float("-inf"))


def _feature_scale(q: Tensor, ranks: Sequence[int], scales: Sequence[float]) -> Tensor:
    """Each feature's level scale, (D,) in q's dtype and device."""
    return torch.cat([torch.full((int(r),), float(s), dtype=q.dtype, device=q.device) for r, s in zip(ranks, scales)])


@torch.library.custom_op("mixer_plugins::mlr_attention_tiled", mutates_args=())
def mlr_attention_tiled(q: Tensor, k: Tensor, v: Tensor, key_real: Optional[Tensor], ranks: list[int],
                        block_sizes: list[int], scales: list[float], causal: bool, block_divide: bool,
                        engine: str) -> tuple[Tensor, Tensor]:
    """The tiled op on prepared inputs: q, k (B, L, H, D), v (B, L, H, P) (any strides), ``scales`` the level
    scales (applied inside: by the native engine as it reads each query tile, by the others to a scaled copy of q),
    ``key_real`` (B, L) bool or None (pad keys are excluded; their q/k/v must be finite), ``block_sizes`` with 0 for
    a global level, ``engine`` ``"native"`` (:mod:`.native`, right-padded ``key_real`` only), ``"matmul"``
    (:mod:`.chunked`) or ``"flash"``. Returns the output (B, L, H, P) and the log-sum-exp (B, L, H) of every row
    (float64 for float64 inputs, else float32)."""
    if engine == "native":
        return native.forward(q, k, v, _key_lengths(key_real), ranks, block_sizes, scales, causal, block_divide)
    q = q * _feature_scale(q, ranks, scales)
    plan = _plan(q.shape[1], ranks, block_sizes, causal, block_divide)
    if engine == "matmul":
        out, lse = chunked_forward(_head_major(q), _head_major(k), _head_major(v), _key_bias(key_real, q.dtype), plan)
        return _head_major(out), _head_major(lse)
    out, lse = _tiled_forward(q, k, v, key_real, plan, (True,) * len(plan.groups))
    return out[..., : v.shape[-1]].contiguous(), lse


@mlr_attention_tiled.register_fake
def _mlr_attention_tiled_fake(q, k, v, key_real, ranks, block_sizes, scales, causal, block_divide, engine):
    batch, length, heads, _ = q.shape
    return (q.new_empty(batch, length, heads, v.shape[-1]),
            q.new_empty((batch, length, heads), dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("mixer_plugins::mlr_attention_tiled_backward", mutates_args=())
def mlr_attention_tiled_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, key_real: Optional[Tensor],
                                 out: Tensor, lse: Tensor, ranks: list[int], block_sizes: list[int],
                                 scales: list[float], causal: bool, block_divide: bool,
                                 engine: str) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of :func:`mlr_attention_tiled` given its output and log-sum-exp."""
    if engine == "native":
        return native.backward(dout, q, k, v, out, lse, _key_lengths(key_real), ranks, block_sizes, scales, causal,
                               block_divide)
    feature_scale = _feature_scale(q, ranks, scales)
    q = q * feature_scale
    plan = _plan(q.shape[1], ranks, block_sizes, causal, block_divide)
    if engine == "matmul":
        dq, dk, dv = (_head_major(g) for g in chunked_backward(
            _head_major(dout), _head_major(q), _head_major(k), _head_major(v), _key_bias(key_real, q.dtype),
            _head_major(out), _head_major(lse), plan))
    else:
        flash = (True,) * len(plan.groups)
        width = max(q.shape[-1], v.shape[-1])
        dq, dk, dv = _tiled_backward(dout, q, k, v, key_real, _pad(out, width), lse, plan, flash)
    # as the fake kernel says (contiguous: the compiler plans memory from it); dq of the unscaled queries
    return (dq * feature_scale).contiguous(), dk.contiguous(), dv.contiguous()


@mlr_attention_tiled_backward.register_fake
def _mlr_attention_tiled_backward_fake(dout, q, k, v, key_real, out, lse, ranks, block_sizes, scales, causal,
                                       block_divide, engine):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, key_real, ranks, block_sizes, scales, causal, block_divide, engine = inputs
    out, lse = output
    save_tensors(ctx, q=q, k=k, v=v, key_real=key_real, out=out, lse=lse)
    ctx.args = (ranks, block_sizes, scales, causal, block_divide, engine)


def _backward(ctx, dout, dlse):
    s = saved_tensors(ctx)
    dq, dk, dv = mlr_attention_tiled_backward(dout, s.q, s.k, s.v, s.key_real, s.out, s.lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


mlr_attention_tiled.register_autograd(_backward, setup_context=_setup)


def paper_flops(batch: int, heads: int, length: int, ranks: Sequence[int], block_sizes: Sequence[Optional[int]],
                value_width: int) -> dict[str, int]:
    """Forward FLOPs of MLR attention as counted (2 per multiply-add): each (query, key) pair of the ``L x L``
    score matrix costs the features of the levels whose block holds both (``sum_l r_l * sum over level-l blocks of
    size^2``), and ``value_width`` for its share of ``A V``. Causal masking is not subtracted, as PyTorch's own
    attention formula does not; padding the kernel may execute (the flash engine) is not added."""
    score_macs = 0
    for rank, size in zip(ranks, block_sizes):
        if size is None or size <= 0 or size >= length:
            pairs = length * length
        else:
            full, rem = divmod(length, size)
            pairs = full * size * size + rem * rem
        score_macs += rank * pairs
    return {"scores": 2 * batch * heads * score_macs,
            "weighted_values": 2 * batch * heads * length * length * value_width}


@register_flop_formula(torch.ops.mixer_plugins.mlr_attention_tiled)
def _flop_formula(q_shape, k_shape, v_shape, key_real_shape, ranks, block_sizes, *args, out_shape=None,
                  **kwargs) -> int:
    batch, length, heads, _ = q_shape
    return sum(paper_flops(batch, heads, length, ranks, block_sizes, v_shape[-1]).values())


@register_flop_formula(torch.ops.mixer_plugins.mlr_attention_tiled_backward)
def _backward_flop_formula(dout_shape, q_shape, k_shape, v_shape, key_real_shape, out_shape_, lse_shape, ranks,
                           block_sizes, *args, out_shape=None, **kwargs) -> int:
    # as PyTorch counts attention's backward: scores recomputed, dQ and dK (3x the score FLOPs); dP and dV (2x)
    batch, length, heads, _ = q_shape
    parts = paper_flops(batch, heads, length, ranks, block_sizes, v_shape[-1])
    return 3 * parts["scores"] + 2 * parts["weighted_values"]


def mlr_attention_torch(q: Tensor, k: Tensor, v: Tensor, *, ranks: Sequence[int],
                        block_sizes: Sequence[Optional[int]], scales: Sequence[float], causal: bool = False,
                        mask: Tensor | None = None, block_divide: bool = True, engine: str = "auto",
                        leaf_max: int = LEAF_MAX) -> Tensor:
    """The tiled fast path (see the module docstring); arguments as :func:`mixer_plugins.kernels.mlr_attention`.

    ``engine``: ``"auto"`` (:data:`AUTO_ENGINE` where it can run, else the next of :data:`ENGINES` that can),
    ``"native"`` (our fused C++ CPU kernel, :mod:`.native`: float32/float64, compiled on first use), ``"matmul"``
    (the chunked matmul engine, :mod:`.chunked`: any device and dtype, no padding) or ``"flash"`` (PyTorch's fused
    CPU kernel, keys zero-padded to the head width). ``leaf_max``: blocks of at most this many tokens are computed
    with all their finer levels at once (0: never; an eager-only experiment, see :data:`LEAF_MAX`). Under
    ``torch.export`` the materialized formula is traced instead (see the module docstring).
    """
    if torch.compiler.is_exporting():
        return mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=block_sizes, scales=scales, causal=causal,
                                       mask=mask, block_divide=block_divide)
    length = q.shape[1]
    key_real = None
    if mask is not None:
        real = mask[:, :, None, None]
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        q, k, v = (torch.where(real, t, zero) for t in (q, k, v))  # select: NaN in pads never propagates
        key_real = mask | ~mask.any(dim=1, keepdim=True)  # a row with no real token keeps every key
    chosen = _engine(q, engine)
    if leaf_max:
        q = q * _feature_scale(q, ranks, scales)
        flash = chosen == "flash" or (chosen == "native" and _flash_possible(q))  # no native leaf
        plan = plan_tasks(length, ranks, block_sizes, causal=causal, block_divide=block_divide, dyadic=flash,
                          leaf_max=leaf_max)
        out = _TiledMLR.apply(q, k, v, key_real, plan, (flash,) * len(plan.groups))
    else:
        out, _ = mlr_attention_tiled(q, k, v, key_real, list(ranks), _sizes_arg(block_sizes),
                                     [float(s) for s in scales], causal, block_divide, chosen)
    if mask is not None:
        out = torch.where(mask[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


impl = mlr_attention_torch  # the backend entry point, as in every op folder
BACKEND = register(Backend(op="mlr_attention", name="torch", impl=impl, priority=10))
