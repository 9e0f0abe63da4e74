"""The ``chunked`` engine of the tiled MLR op: no padding, a few large batched matmuls per task.

Each task of a :class:`~.torch.MLRPlan` (a rectangle of queries against keys, batched over its ``count`` parents,
the batch and the heads) is computed at its group's own width ``R_m = r_0 + ... + r_m``: scores ``Q_m K_m^T`` by one
``bmm``, the row max, ``exp`` in place, the row sum, ``P V`` by one ``bmm``; its normalized output and log-sum-exp
are merged into the running ones per query (flash attention's split-KV merge). Rows are taken in *chunks* so that a
chunk's scores never exceed ``budget`` elements (they live in one scratch buffer, reused by every task): memory is
``O(L)`` plus that constant. The backward recomputes each chunk's probabilities from the row's final log-sum-exp (so
each task's gradient is its exact share of the whole softmax's) with five ``bmm``: ``dP = dO V^T``,
``dS = P (dP - delta)``, ``dV += P^T dO``, ``dQ += dS K``, ``dK += dS^T Q``.

Tensors here are head-major: q, k (B, H, L, D) with the level scales already applied to q, v (B, H, L, P); ``bias``
(B, L) is 0 on real keys and ``-inf`` on pads (or None).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .plan import MLRPlan, Task

__all__ = ["DEFAULT_BUDGET", "chunked_backward", "chunked_forward"]

#: score elements of one chunk (the scratch buffer): 2^22 = 16 MiB in float32. Big enough that a chunk's ``bmm`` and
#: elementwise passes dwarf their Python overhead, small enough to stay near the caches.
DEFAULT_BUDGET = 1 << 22


def _rows(t: Tensor, task: Task, lo: int, hi: int) -> Tensor:
    """(B, H, L, W) -> (B, H, count, hi - lo, W) view: rows ``q0 + lo .. q0 + hi`` of each of the task's parents."""
    parents = t.narrow(2, task.start, task.count * task.plen).unflatten(2, (task.count, task.plen))
    return parents[:, :, :, task.q0 + lo: task.q0 + hi]


def _keys(t: Tensor, task: Task, k_len: int) -> Tensor:
    """(B, H, L, W) -> (B, H, count, k_len, W) view of the task's first ``k_len`` keys in each parent."""
    parents = t.narrow(2, task.start, task.count * task.plen).unflatten(2, (task.count, task.plen))
    return parents[:, :, :, task.k0: task.k0 + k_len]


def _flat(t: Tensor) -> Tensor:
    """(B, H, count, n, W) -> (B * H * count, n, W) (a copy when the view cannot be merged)."""
    return t.reshape(t.shape[0] * t.shape[1] * t.shape[2], t.shape[3], t.shape[4])


def _chunk_rows(task: Task, batch_heads: int, budget: int) -> int:
    return max(1, min(task.q_len, budget // max(1, batch_heads * task.count * task.k_len)))


def _scratch_size(plan: MLRPlan, batch_heads: int, budget: int) -> int:
    """Elements of the largest chunk's scores (at most ``budget``, unless one row of a task exceeds it)."""
    need = [_chunk_rows(t, batch_heads, budget) * batch_heads * t.count * t.k_len for g in plan.groups for t in g.tasks]
    return max(need, default=0)


def _key_bias(bias: Tensor | None, task: Task, k_len: int) -> Tensor | None:
    """(B, 1, count, 1, k_len) additive key bias of the task, or None."""
    if bias is None:
        return None
    parents = bias.narrow(1, task.start, task.count * task.plen).unflatten(1, (task.count, task.plen))
    return parents[:, None, :, None, task.k0: task.k0 + k_len]


def _scores(a: Tensor, kt: Tensor, scratch: Tensor, task: Task, lo: int, n: int, shape5: tuple[int, ...],
            kbias: Tensor | None) -> Tensor:
    """Scores of rows ``lo .. lo + n`` of a task into the scratch buffer, (N, n, k_len), masked."""
    k_len = kt.shape[1]
    s = scratch[: a.shape[0] * n * k_len].view(a.shape[0], n, k_len)
    if a.shape[-1]:
        torch.bmm(a, kt.transpose(1, 2), out=s)
    else:  # a group of pairs that share no level: score 0
        s.zero_()
    if kbias is not None:
        s.view(*shape5[:3], n, k_len).add_(kbias)
    if task.causal:  # key k0 + j allowed for query q0 + lo + i iff j <= lo + i (q range == k range)
        rows = torch.arange(lo, lo + n, device=s.device)[:, None]
        cols = torch.arange(k_len, device=s.device)[None, :]
        s.masked_fill_(cols > rows, float("-inf"))
    return s


def chunked_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, plan: MLRPlan,
                    budget: int | None = None) -> tuple[Tensor, Tensor]:
    """Output (B, H, L, P) and log-sum-exp (B, H, L) (float64 for float64 inputs, else float32); ``budget``: score
    elements per chunk (None: :data:`DEFAULT_BUDGET`, read at call time)."""
    budget = budget or DEFAULT_BUDGET
    batch, heads, length, _ = q.shape
    pv = v.shape[-1]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(batch, heads, length, pv, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads, length), float("-inf"), dtype=lse_dtype, device=q.device)
    scratch = torch.empty(_scratch_size(plan, batch * heads, budget), dtype=q.dtype, device=q.device)
    for group in plan.groups:
        w = group.width
        for task in group.tasks:
            rows_per = _chunk_rows(task, batch * heads, budget)
            kt_all = _flat(_keys(k, task, task.k_len)[..., :w])
            vt_all = _flat(_keys(v, task, task.k_len))
            for lo in range(0, task.q_len, rows_per):
                n = min(rows_per, task.q_len - lo)
                k_len = min(task.k_len, lo + n) if task.causal else task.k_len  # later keys: all masked
                kt, vt = kt_all[:, :k_len], vt_all[:, :k_len]
                a = _flat(_rows(q, task, lo, lo + n)[..., :w] * group.scale)
                shape5 = (batch, heads, task.count, n, k_len)
                s = _scores(a, kt, scratch, task, lo, n, shape5, _key_bias(bias, task, k_len))
                m = s.amax(-1, keepdim=True)
                if bias is not None:  # rows whose keys are all pads: a finite max, then a zero sum
                    m.clamp_(min=torch.finfo(s.dtype).min)
                s.sub_(m).exp_()
                total = s.sum(-1, keepdim=True)
                o = torch.bmm(s, vt)
                if bias is not None:
                    o.mul_(total.reciprocal().masked_fill_(total == 0, 0))
                else:  # every row has an allowed key (its own, or all of them)
                    o.div_(total)
                task_lse = m.add_(total.log_()).to(lse_dtype)
                _merge(_rows(out, task, lo, lo + n), _rows(lse[..., None], task, lo, lo + n)[..., 0],
                       o.view(batch, heads, task.count, n, pv), task_lse.view(batch, heads, task.count, n))
    return out, lse


def _merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold a task's normalized ``out`` (.., W) and ``lse`` (..) into the running ones, in place (``lerp`` by the
    task's share ``exp(lse - logaddexp(acc_lse, lse))``; 0 while both are ``-inf``)."""
    new = torch.logaddexp(acc_lse, lse)
    take = torch.exp(lse - new.masked_fill(torch.isinf(new), 0))
    acc_out.lerp_(out, take.to(acc_out.dtype)[..., None])
    acc_lse.copy_(new)


def chunked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor,
                     plan: MLRPlan, budget: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) given the final output and log-sum-exp of :func:`chunked_forward`."""
    budget = budget or DEFAULT_BUDGET
    batch, heads, length, _ = q.shape
    pv = v.shape[-1]
    delta = (dout * out).sum(-1, keepdim=True).to(lse.dtype)  # (B, H, L, 1)
    row_lse = lse[..., None]
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    size = _scratch_size(plan, batch * heads, budget)
    scratch = torch.empty(2 * size, dtype=q.dtype, device=q.device)
    probs, grads = scratch[:size], scratch[size:]
    for group in plan.groups:
        w = group.width
        for task in group.tasks:
            rows_per = _chunk_rows(task, batch * heads, budget)
            k_full = task.k_len
            kt_all = _flat(_keys(k, task, k_full)[..., :w])
            vt_all = _flat(_keys(v, task, k_full))
            dk_acc = torch.zeros_like(kt_all)
            dv_acc = torch.zeros_like(vt_all)
            for lo in range(0, task.q_len, rows_per):
                n = min(rows_per, task.q_len - lo)
                k_len = min(k_full, lo + n) if task.causal else k_full
                kt, vt = kt_all[:, :k_len], vt_all[:, :k_len]
                a = _flat(_rows(q, task, lo, lo + n)[..., :w] * group.scale)
                do = _flat(_rows(dout, task, lo, lo + n))
                shape5 = (batch, heads, task.count, n, k_len)
                p = _scores(a, kt, probs, task, lo, n, shape5, _key_bias(bias, task, k_len))
                p.sub_(_flat(_rows(row_lse, task, lo, lo + n)).to(p.dtype)).exp_()
                ds = grads[: p.numel()].view(p.shape)
                torch.bmm(do, vt.transpose(1, 2), out=ds)
                ds.sub_(_flat(_rows(delta, task, lo, lo + n)).to(ds.dtype)).mul_(p)
                dv_acc[:, :k_len].baddbmm_(p.transpose(1, 2), do)
                if w:
                    dk_acc[:, :k_len].baddbmm_(ds.transpose(1, 2), a)
                    dq_rows = torch.bmm(ds, kt).mul_(group.scale)
                    _rows(dq, task, lo, lo + n)[..., :w].add_(dq_rows.view(batch, heads, task.count, n, w))
            _keys(dk, task, k_full)[..., :w].add_(dk_acc.view(batch, heads, task.count, k_full, w))
            _keys(dv, task, k_full).add_(dv_acc.view(batch, heads, task.count, k_full, pv))
    return dq, dk, dv
