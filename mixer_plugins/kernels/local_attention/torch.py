"""Blocked sliding-window attention (the ``torch`` backend of :func:`..local_attention`): ``O(L * window)``.

Queries are cut into chunks of ``chunk = window`` tokens; chunk ``m`` scores the keys of chunks ``m-1, m`` (causal)
or ``m-1, m, m+1`` (bidirectional), which hold every key within ``window`` of its queries: the key chunks outside the
band are never touched. With global tokens (the first ``num_global``), every chunk also scores the global keys (one
softmax over band + global keys; a global key inside the band is counted once, in the global part) and the global
queries' rows are computed densely against every key. When that tiling would cost at least as much as the plain
``L x L`` scores (short sequences, wide windows) it computes them densely instead (:class:`LocalPlan`).

The op is a ``torch.library`` custom op (:data:`local_attention_blocked`) with an opaque backward op (the vector-
Jacobian product of the same blocked computation), so ``torch.compile(fullgraph=True)`` sees one node and
``FlopCounterMode`` counts the executed pairs (:func:`local_attention_flops`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._dispatch import Backend, register
from .._library import save_tensors, saved_tensors
from .reference import allowed_pairs

__all__ = ["LocalPlan", "local_attention_blocked", "local_attention_flops", "local_attention_torch"]


class LocalPlan:
    """How the blocked path tiles a length-``L`` sequence for window ``w`` and ``num_global`` global tokens.

    Queries are cut into chunks of ``chunk = w`` tokens (at least 1); chunk ``k`` sees the keys of chunks ``k-1, k``
    (causal) or ``k-1, k, k+1`` (bidirectional), which hold every key within ``w`` of its queries. ``dense`` is True
    when that tiling would cost at least as much as the plain L x L scores (short sequences, wide windows).
    """

    def __init__(self, length: int, window: int, causal: bool, num_global: int = 0):
        self.length = length
        self.num_global = num_global
        self.chunk = max(1, min(window, length))
        self.num_chunks = math.ceil(length / self.chunk)
        self.offsets = (-1, 0) if causal else (-1, 0, 1)
        self.keys_per_chunk = len(self.offsets) * self.chunk
        padded = self.num_chunks * self.chunk
        self._blocked = padded * self.keys_per_chunk + num_global * (padded + length)
        self.dense = self.num_chunks == 1 or self._blocked >= length * length

    def pairs(self) -> int:
        """Number of (query, key) score entries computed per (batch, head)."""
        return self.length * self.length if self.dense else self._blocked


def local_attention_flops(batch: int, heads: int, length: int, window: int, causal: bool, qk_dim: int, v_dim: int,
                          *, num_global: int = 0) -> dict[str, int]:
    """FLOPs (2 per multiply-add) of the blocked path (what ``FlopCounterMode`` counts for the op): the executed
    score entries times ``qk_dim`` and times ``v_dim`` for the weighted values."""
    pairs = LocalPlan(length, window, causal, num_global).pairs()
    return {"scores": 2 * batch * heads * pairs * qk_dim, "weighted_values": 2 * batch * heads * pairs * v_dim}


def _softmax(scores: Tensor, allowed: Tensor) -> Tensor:
    # disallowed scores -> the most negative finite value (not -inf): a row with no allowed key stays finite
    return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).softmax(dim=-1)


def _blocked(q: Tensor, k: Tensor, v: Tensor, key_real: Tensor | None, window: int, num_global: int, causal: bool,
             scale: float) -> Tensor:
    """The blocked forward (plain PyTorch, differentiable); shapes and masks as :func:`local_attention_blocked`."""
    b, length, h, _ = q.shape
    device = q.device
    plan = LocalPlan(length, window, causal, num_global)
    if plan.dense:
        allowed = allowed_pairs(length, window, causal, num_global, device)[None, None]
        if key_real is not None:
            allowed = allowed & key_real[:, None, None, :]
        probs = _softmax(torch.einsum("bihe,bjhe->bhij", q, k) * scale, allowed)
        return torch.einsum("bhij,bjhp->bihp", probs, v)

    c, n, G = plan.chunk, plan.num_chunks, num_global
    padded = n * c
    extra = padded - length

    def chunks(t: Tensor) -> Tensor:  # (b, L, h, e) -> (b, n, c, h, e), zero-padded at the end
        return F.pad(t, (0, 0, 0, 0, 0, extra)).view(b, n, c, h, t.shape[-1])

    def neighbours(t: Tensor) -> Tensor:  # (b, n, c, h, e) -> (b, n, len(offsets) * c, h, e)
        framed = F.pad(t, (0, 0, 0, 0, 0, 0, 1, 1))  # one empty chunk before and after
        return torch.cat([framed[:, 1 + off: 1 + off + n] for off in plan.offsets], dim=2)

    qc = chunks(q)
    kc = neighbours(chunks(k))
    vc = neighbours(chunks(v))

    # absolute positions of every query and key slot: the band / causal / padding mask of each chunk
    qpos = torch.arange(padded, device=device).view(n, c)
    starts = torch.arange(n, device=device)[:, None] * c
    kpos = torch.cat([starts + off * c + torch.arange(c, device=device) for off in plan.offsets], dim=1)  # (n, K)
    diff = qpos[:, :, None] - kpos[:, None, :]  # (n, c, K)
    allowed = (diff.abs() <= window) & (kpos >= G)[:, None, :] & (kpos < length)[:, None, :]
    if causal:
        allowed = allowed & (diff >= 0)
    allowed = allowed[None]  # (1, n, c, K)
    if key_real is not None:
        slots = F.pad(key_real, (c, extra + c))[:, kpos + c]  # (b, n, K): False on pads and out-of-range slots
        allowed = allowed & slots[:, :, None, :]
    scores = torch.einsum("bnqhe,bnkhe->bhnqk", qc, kc) * scale
    if G:  # every chunk also scores the global keys
        gpos = torch.arange(G, device=device)
        g_allowed = (gpos[None, None, :] <= qpos[:, :, None]) if causal else torch.ones(
            n, c, G, dtype=torch.bool, device=device)
        g_allowed = g_allowed[None]
        if key_real is not None:
            g_allowed = g_allowed & key_real[:, None, None, :G]
        scores = torch.cat([scores, torch.einsum("bnqhe,bkhe->bhnqk", qc, k[:, :G]) * scale], dim=-1)
        allowed = torch.cat([allowed.expand(g_allowed.shape[0], -1, -1, -1), g_allowed], dim=-1)
    probs = _softmax(scores, allowed[:, None])
    K = kc.shape[2]
    y = torch.einsum("bhnqk,bnkhp->bnqhp", probs[..., :K], vc)
    if G:
        y = y + torch.einsum("bhnqk,bkhp->bnqhp", probs[..., K:], v[:, :G])
    y = y.reshape(b, padded, h, v.shape[-1])[:, :length]
    if G:  # the global queries see every key: dense rows
        pos = torch.arange(length, device=device)
        r_allowed = (pos[None, :] <= pos[:G, None]) if causal else torch.ones(G, length, dtype=torch.bool,
                                                                                device=device)
        r_allowed = r_allowed[None, None]
        if key_real is not None:
            r_allowed = r_allowed & key_real[:, None, None, :]
        r_probs = _softmax(torch.einsum("bihe,bjhe->bhij", q[:, :G], k) * scale, r_allowed)
        y = torch.cat([torch.einsum("bhij,bjhp->bihp", r_probs, v), y[:, G:]], dim=1)
    return y


@torch.library.custom_op("mixer_plugins::local_attention_blocked", mutates_args=())
def local_attention_blocked(q: Tensor, k: Tensor, v: Tensor, key_real: Optional[Tensor], window: int,
                            num_global: int, causal: bool, scale: float) -> Tensor:
    """The blocked op: q, k (B, L, H, E), v (B, L, H, P) (finite: pads already selected away), ``key_real`` (B, L)
    bool or None (False keys are excluded). Returns (B, L, H, P) (pad rows are not zeroed here)."""
    return _blocked(q, k, v, key_real, window, num_global, causal, scale).contiguous()


@local_attention_blocked.register_fake
def _local_attention_blocked_fake(q, k, v, key_real, window, num_global, causal, scale):
    return q.new_empty(*q.shape[:3], v.shape[-1])


@torch.library.custom_op("mixer_plugins::local_attention_blocked_backward", mutates_args=())
def local_attention_blocked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, key_real: Optional[Tensor],
                                     window: int, num_global: int, causal: bool,
                                     scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of :func:`local_attention_blocked` (the vector-Jacobian product of the same blocked
    computation, recomputed)."""
    _, vjp = torch.func.vjp(lambda a, b_, c: _blocked(a, b_, c, key_real, window, num_global, causal, scale),
                            q, k, v)
    return tuple(g.contiguous() for g in vjp(dout))


@local_attention_blocked_backward.register_fake
def _local_attention_blocked_backward_fake(dout, q, k, v, key_real, window, num_global, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, key_real, window, num_global, causal, scale = inputs
    save_tensors(ctx, q=q, k=k, v=v, key_real=key_real)
    ctx.args = (window, num_global, causal, scale)


def _backward(ctx, dout):
    s = saved_tensors(ctx)
    dq, dk, dv = local_attention_blocked_backward(dout.contiguous(), s.q, s.k, s.v, s.key_real, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


local_attention_blocked.register_autograd(_backward, setup_context=_setup)


@register_flop_formula(torch.ops.mixer_plugins.local_attention_blocked)
def _flop_formula(q_shape, k_shape, v_shape, key_real_shape, window, num_global, causal, *args, out_shape=None,
                  **kwargs) -> int:
    batch, length, heads, e = q_shape
    return sum(local_attention_flops(batch, heads, length, window, causal, e, v_shape[-1],
                                     num_global=num_global).values())


@register_flop_formula(torch.ops.mixer_plugins.local_attention_blocked_backward)
def _backward_flop_formula(dout_shape, q_shape, k_shape, v_shape, key_real_shape, window, num_global, causal,
                           *args, out_shape=None, **kwargs) -> int:
    # as PyTorch counts attention's backward: scores recomputed, dQ and dK (3x the score FLOPs); dP and dV (2x)
    batch, length, heads, e = q_shape
    parts = local_attention_flops(batch, heads, length, window, causal, e, v_shape[-1], num_global=num_global)
    return 3 * parts["scores"] + 2 * parts["weighted_values"]


def local_attention_torch(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool = False,
                          mask: Tensor | None = None, scale: float, num_global: int = 0) -> Tensor:
    """The blocked path (see the module docstring); arguments as :func:`mixer_plugins.kernels.local_attention`
    (pads already selected away by it)."""
    return local_attention_blocked(q, k, v, mask, int(window), int(num_global), bool(causal), float(scale))


impl = local_attention_torch  # the backend entry point, as in every op folder
BACKEND = register(Backend(op="local_attention", name="torch", impl=impl, priority=10))
