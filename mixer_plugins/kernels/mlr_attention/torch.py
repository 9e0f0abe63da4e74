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
each task's gradient is exactly its share of the full softmax's gradient (split-KV backward).

Engines (``engine=``): ``native`` (the op's ``native`` backend, :mod:`.native`: our fused C++ kernel, right padding
only) and ``matmul`` (its ``torch`` backend, :mod:`.chunked`: batched matmuls per task, any device and dtype). Both
run inside one ``torch.library`` custom op (:func:`mlr_attention_tiled`, with its backward op), so ``torch.compile``
sees one node and ``FlopCounterMode`` counts it by its registered formula (the paper's count, :func:`paper_flops`).

Under ``torch.export`` (and so ``torch.onnx.export(..., dynamo=True)``) the materialized formula of
:mod:`.reference` is traced instead (standard ops only, ``O(L^2)`` memory like plain attention), so an exported graph
runs without this library and translates to ONNX.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._library import save_tensors, saved_tensors
from . import native
from .chunked import chunked_backward, chunked_forward
from .plan import MLRPlan, Task, plan_tasks
from .reference import mlr_attention_reference

__all__ = ["ENGINES", "MLRPlan", "Task", "mlr_attention_tiled", "mlr_attention_torch", "paper_flops",
           "plan_tasks"]

#: the engines of the tiled op: ``native`` is the op's ``native`` backend, ``matmul`` its ``torch`` one
ENGINES = ("native", "matmul")


# -- the custom op: what torch.compile, torch.export and FlopCounterMode see --------------------------------------

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


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}; got {engine!r}")


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
    a global level, ``engine`` ``"native"`` (:mod:`.native`, right-padded ``key_real`` only) or ``"matmul"``
    (:mod:`.chunked`). Returns the output (B, L, H, P) and the log-sum-exp (B, L, H) of every row
    (float64 for float64 inputs, else float32)."""
    _check_engine(engine)
    if engine == "native":
        return native.forward(q, k, v, _key_lengths(key_real), ranks, block_sizes, scales, causal, block_divide)
    q = q * _feature_scale(q, ranks, scales)
    plan = _plan(q.shape[1], ranks, block_sizes, causal, block_divide)
    out, lse = chunked_forward(_head_major(q), _head_major(k), _head_major(v), _key_bias(key_real, q.dtype), plan)
    return _head_major(out), _head_major(lse)


@mlr_attention_tiled.register_fake
def _mlr_attention_tiled_fake(q, k, v, key_real, ranks, block_sizes, scales, causal, block_divide, engine):
    batch, length, heads, _ = q.shape
    return (q.new_empty(batch, length, heads, v.shape[-1]),
            q.new_empty((batch, length, heads), dtype=torch.promote_types(q.dtype, torch.float32)))


@torch.library.custom_op("mixer_plugins::mlr_attention_tiled_backward", mutates_args=())
def mlr_attention_tiled_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, key_real: Optional[Tensor],
                                 out: Tensor, lse: Tensor, ranks: list[int], block_sizes: list[int],
                                 scales: list[float], causal: bool, block_divide: bool,
                                 engine: str) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of :func:`mlr_attention_tiled` given its output and log-sum-exp."""
    _check_engine(engine)
    if engine == "native":
        return native.backward(dout, q, k, v, out, lse, _key_lengths(key_real), ranks, block_sizes, scales, causal,
                               block_divide)
    feature_scale = _feature_scale(q, ranks, scales)
    q = q * feature_scale
    plan = _plan(q.shape[1], ranks, block_sizes, causal, block_divide)
    dq, dk, dv = (_head_major(g) for g in chunked_backward(
        _head_major(dout), _head_major(q), _head_major(k), _head_major(v), _key_bias(key_real, q.dtype),
        _head_major(out), _head_major(lse), plan))
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
    attention formula does not."""
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
                        mask: Tensor | None = None, block_divide: bool = True, engine: str = "matmul") -> Tensor:
    """The tiled fast path (see the module docstring); arguments as :func:`mixer_plugins.kernels.mlr_attention`,
    and ``engine``: ``"matmul"`` or ``"native"`` (CPU float32/float64)."""
    _check_engine(engine)
    if engine == "native" and not torch.compiler.is_compiling():
        if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the native engine takes float32 or float64 CPU tensors; got {q.device.type} {q.dtype}")
    if torch.compiler.is_exporting():
        return mlr_attention_reference(q, k, v, ranks=ranks, block_sizes=block_sizes, scales=scales, causal=causal,
                                       mask=mask, block_divide=block_divide)
    key_real = None
    if mask is not None:
        real = mask[:, :, None, None]
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        q, k, v = (torch.where(real, t, zero) for t in (q, k, v))  # select: NaN in pads never propagates
        key_real = mask | ~mask.any(dim=1, keepdim=True)  # a row with no real token keeps every key
    sizes = [0 if s is None else int(s) for s in block_sizes]  # the op schema has no optional ints in lists
    out, _ = mlr_attention_tiled(q, k, v, key_real, list(ranks), sizes,
                                 [float(s) for s in scales], causal, block_divide, engine)
    if mask is not None:
        out = torch.where(mask[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out
