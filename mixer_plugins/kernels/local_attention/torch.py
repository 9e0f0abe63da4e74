"""Blocked sliding-window attention (the ``torch`` backend of :func:`..local_attention`): ``O(L * window)``.

Queries are cut into chunks of ``chunk = window`` tokens; chunk ``m`` scores the keys of chunks ``m-1, m`` (causal)
or ``m-1, m, m+1`` (bidirectional), which hold every key within ``window`` of its queries: the key chunks outside the
band are never touched. With global tokens (the first ``num_global``), every chunk also scores the global keys (one
softmax over band + global keys; a global key inside the band is counted once, in the global part) and the global
queries' rows are computed densely against every key. When that tiling would cost at least as much as the plain
``L x L`` scores (short sequences, wide windows) it computes them densely instead (:class:`LocalPlan`).

The op is a ``torch.library`` custom op (:data:`local_attention_blocked`) with an opaque backward op (from the
probabilities the forward keeps, ``O(L * window)``, as autograd through the blocked path would), so
``torch.compile(fullgraph=True)`` sees one node and
``FlopCounterMode`` counts the executed pairs (:func:`local_attention_flops`). Under ``torch.export`` (and so
``torch.onnx.export(..., dynamo=True)``) the same blocked formula is traced as plain ops instead of the custom op, so
an exported graph holds standard ops only; with a symbolic length (a dynamic axis) its chunks are gathered by index
(:func:`_blocked_by_index`), so that the graph runs at every length.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .._library import save_tensors, saved_tensors
from .reference import allowed_pairs

__all__ = ["LocalPlan", "local_attention_blocked", "local_attention_flops", "local_attention_torch"]


class LocalPlan:
    """How the blocked path tiles a length-``L`` sequence for window ``w`` and ``num_global`` global tokens (see the
    module docstring); ``dense``: whether it computes the plain ``L x L`` scores instead."""

    def __init__(self, length: int, window: int, causal: bool, num_global: int = 0):
        self.length = length
        self.num_global = num_global
        self.chunk = max(1, min(window, length))
        self.num_chunks = -(-length // self.chunk)
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


def _dscores(probs: Tensor, dprobs: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """Gradient w.r.t. the dot products of ``scale * dots -> masked softmax`` (disallowed entries: 0), without the
    factor ``scale`` (the callers apply it to the smaller products)."""
    ds = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))   # the softmax's backward: p * (dp - <dp, p>)
    return ds.masked_fill_(~allowed, 0)


def _allowed(qpos: Tensor, kpos: Tensor, length: int, window: int, num_global: int, causal: bool,
             key_real: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Which keys each chunk's queries ``qpos`` (n, c) may attend: (b or 1, n, c, K [+ G]), its key slots ``kpos``
    (n, K) (band, causal and padding masks) and then the global keys; and the global queries' dense rows (b or 1, 1,
    G, L) (None without global tokens)."""
    n, c = qpos.shape
    G, device = num_global, qpos.device
    diff = qpos[:, :, None] - kpos[:, None, :]
    allowed = (diff.abs() <= window) & (kpos >= G)[:, None, :] & (kpos < length)[:, None, :]
    if causal:
        allowed = allowed & (diff >= 0)
    allowed = allowed[None]
    if key_real is not None:  # key slots off the ends read the padding: False
        allowed = allowed & F.pad(key_real, (c, 3 * c))[:, kpos + c][:, :, None, :]
    if not G:
        return allowed, None
    gpos, pos = torch.arange(G, device=device), torch.arange(length, device=device)
    g_allowed = (gpos <= qpos[:, :, None]) if causal else torch.ones(n, c, G, dtype=torch.bool, device=device)
    rows = (pos[None, :] <= pos[:G, None]) if causal else torch.ones(G, length, dtype=torch.bool, device=device)
    g_allowed, rows = g_allowed[None], rows[None, None]
    if key_real is not None:
        g_allowed = g_allowed & key_real[:, None, None, :G]
        rows = rows & key_real[:, None, None, :]
    allowed = torch.cat([allowed.expand(g_allowed.shape[0], -1, -1, -1),
                         g_allowed.expand(allowed.shape[0], -1, -1, -1)], dim=-1)
    return allowed, rows


def _attend_chunks(qc: Tensor, kc: Tensor, vc: Tensor, k: Tensor, v: Tensor, num_global: int, allowed: Tensor,
                   scale: float) -> tuple[Tensor, Tensor]:
    """Chunk queries ``qc`` (b, n, c, h, e) against their neighbour keys and values ``kc``, ``vc`` (b, n, K, h, *)
    and the global keys: the probabilities (b, n, h, c, K + G) and the output chunks (b, n, c, h, p)."""
    G = num_global
    scores = torch.einsum("bnqhe,bnkhe->bnhqk", qc, kc)
    if G:
        scores = torch.cat([scores, torch.einsum("bnqhe,bkhe->bnhqk", qc, k[:, :G])], dim=-1)
    probs = _softmax(scores * scale, allowed)
    K = kc.shape[2]
    y = torch.einsum("bnhqk,bnkhp->bnqhp", probs[..., :K], vc)
    if G:
        y = y + torch.einsum("bnhqk,bkhp->bnqhp", probs[..., K:], v[:, :G])
    return probs, y


def _dense(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Rows ``q`` against every key: the output and the probabilities."""
    probs = _softmax(torch.einsum("bihe,bjhe->bhij", q, k) * scale, allowed)
    return torch.einsum("bhij,bjhp->bihp", probs, v), probs


class _Blocks:
    """The chunk layout of one call (see :class:`LocalPlan`): chunked / neighbour views and the allowed masks."""

    def __init__(self, q: Tensor, key_real: Tensor | None, plan: LocalPlan, window: int, causal: bool):
        b, length, h, _ = q.shape
        self.plan, self.b, self.h, self.length = plan, b, h, length
        c, n = plan.chunk, plan.num_chunks
        self.padded = n * c
        self.extra = self.padded - length
        qpos = torch.arange(self.padded, device=q.device).view(n, c)
        kpos = torch.cat([qpos + off * c for off in plan.offsets], dim=1)
        allowed, self.rows_allowed = _allowed(qpos, kpos, length, window, plan.num_global, causal, key_real)
        self.allowed = allowed[:, :, None]  # (b or 1, n, 1, c, K [+ G]): probabilities are (b, n, h, c, K [+ G])

    def chunks(self, t: Tensor) -> Tensor:
        """(b, L, h, e) -> (b, n, c, h, e), zero-padded at the end."""
        return F.pad(t, (0, 0, 0, 0, 0, self.extra)).view(self.b, self.plan.num_chunks, self.plan.chunk, self.h,
                                                          t.shape[-1])

    def unchunk(self, t: Tensor) -> Tensor:
        """(b, n, c, h, e) -> (b, L, h, e)."""
        return t.reshape(self.b, self.padded, self.h, t.shape[-1])[:, : self.length]

    def neighbours(self, t: Tensor) -> Tensor:
        """(b, n, c, h, e) -> (b, n, len(offsets) * c, h, e): each chunk's neighbour chunks (zeros off the ends)."""
        n = self.plan.num_chunks
        framed = F.pad(t, (0, 0, 0, 0, 0, 0, 1, 1))  # one empty chunk before and after
        return torch.cat([framed[:, 1 + off: 1 + off + n] for off in self.plan.offsets], dim=2)

    def neighbours_transposed(self, g: Tensor) -> Tensor:
        """The adjoint of :meth:`neighbours`: (b, n, K, h, e) -> (b, n, c, h, e), summing each chunk's shares."""
        n, c = self.plan.num_chunks, self.plan.chunk
        framed = g.new_zeros(g.shape[0], n + 2, c, *g.shape[3:])
        for i, off in enumerate(self.plan.offsets):
            framed[:, 1 + off: 1 + off + n] += g[:, :, i * c: (i + 1) * c]
        return framed[:, 1: 1 + n]


def _dense_allowed(key_real, length, window, num_global, causal, device):
    allowed = allowed_pairs(length, window, causal, num_global, device)[None, None]
    return allowed if key_real is None else allowed & key_real[:, None, None, :]


def _blocked(q: Tensor, k: Tensor, v: Tensor, key_real: Tensor | None, window: int, num_global: int, causal: bool,
             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The blocked forward: (output, probabilities, global rows' probabilities) (see :func:`_prob_shapes`)."""
    length = q.shape[1]
    plan = LocalPlan(length, window, causal, num_global)
    no_rows = q.new_empty(_prob_shapes(q.shape, plan)[1])
    if plan.dense:
        y, probs = _dense(q, k, v, _dense_allowed(key_real, length, window, num_global, causal, q.device), scale)
        return y, probs, no_rows
    blocks = _Blocks(q, key_real, plan, window, causal)
    G = num_global
    kc, vc = blocks.neighbours(blocks.chunks(k)), blocks.neighbours(blocks.chunks(v))
    probs, y = _attend_chunks(blocks.chunks(q), kc, vc, k, v, G, blocks.allowed, scale)
    y = blocks.unchunk(y)
    if not G:
        return y, probs, no_rows
    assert blocks.rows_allowed is not None   # set whenever there are global queries
    y_rows, r_probs = _dense(q[:, :G], k, v, blocks.rows_allowed, scale)  # the global queries see every key
    return torch.cat([y_rows, y[:, G:]], dim=1), probs, r_probs


def _blocked_by_index(q: Tensor, k: Tensor, v: Tensor, key_real: Tensor | None, window: int, num_global: int,
                      causal: bool, scale: float) -> Tensor:
    """The forward of :func:`_blocked` for a symbolic length (a dynamic axis of ``torch.export``), ``O(L * window)``
    as that one, with ``L // window + 2`` chunks gathered by index from the inputs padded by a fixed number of
    tokens, and the output rows gathered back: no shape of the graph depends on the length but through that chunk
    count (:class:`_Blocks` needs a padded length that is a multiple of the chunk, which the exporter cannot bound
    for every length and so fixes to the example's)."""
    length = q.shape[1]
    G = num_global
    c = max(1, window)
    offsets = (-1, 0) if causal else (-1, 0, 1)
    n = length // c + 2  # at least 2 at any length: a chunk count of 1 would be fixed as that size
    qpos = torch.arange(n * c, device=q.device).view(n, c)                  # (n, c): n * c <= length + 2c
    kpos = torch.cat([qpos + off * c for off in offsets], dim=1)            # (n, K): in [-c, length + 3c)
    allowed, rows = _allowed(qpos, kpos, length, window, G, causal, key_real)

    def neighbours(t: Tensor) -> Tensor:  # (b, L, h, e) -> (b, n, K, h, e)
        return F.pad(t, (0, 0, 0, 0, c, 3 * c))[:, kpos + c]

    qc = F.pad(q, (0, 0, 0, 0, 0, 2 * c))[:, qpos]                          # (b, n, c, h, e)
    _, y = _attend_chunks(qc, neighbours(k), neighbours(v), k, v, G, allowed[:, :, None], scale)
    y = y.flatten(1, 2)[:, torch.arange(length, device=q.device)]          # the real rows, (b, L, h, p)
    if not G:
        return y
    assert rows is not None
    return torch.cat([_dense(q[:, :G], k, v, rows, scale)[0], y[:, G:]], dim=1)


def _prob_shapes(q_shape, plan: LocalPlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the probabilities the forward keeps for the backward: the chunks' (b, n, h, c, K + G) (dense:
    (b, h, L, L)) and the global rows' (b, h, G, L) (dense: (b, h, 0, L))."""
    b, length, h = q_shape[:3]
    if plan.dense:
        return (b, h, length, length), (b, h, 0, length)
    return ((b, plan.num_chunks, h, plan.chunk, plan.keys_per_chunk + plan.num_global),
            (b, h, plan.num_global, length))


def _blocked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, key_real: Tensor | None, probs: Tensor,
                      row_probs: Tensor, window: int, num_global: int, causal: bool,
                      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`_blocked` from its kept probabilities, chunk by chunk as in the forward."""
    length = q.shape[1]
    plan = LocalPlan(length, window, causal, num_global)

    def dense(qr, dout_r, p, allowed):  # rows qr (b, R, h, e) against every key
        ds = _dscores(p, torch.einsum("bihp,bjhp->bhij", dout_r, v), allowed, scale)
        return (torch.einsum("bhij,bjhe->bihe", ds, k), torch.einsum("bhij,bihe->bjhe", ds, qr),
                torch.einsum("bhij,bihp->bjhp", p, dout_r))

    if plan.dense:
        dq, dk, dv = dense(q, dout, probs, _dense_allowed(key_real, length, window, num_global, causal, q.device))
        return dq * scale, dk * scale, dv
    blocks = _Blocks(q, key_real, plan, window, causal)
    G = num_global
    if G:  # the global rows' outputs come from the dense rows, not the chunks
        dout_band = torch.cat([torch.zeros_like(dout[:, :G]), dout[:, G:]], dim=1)
    else:
        dout_band = dout
    qc, doc = blocks.chunks(q), blocks.chunks(dout_band)
    kc, vc = blocks.neighbours(blocks.chunks(k)), blocks.neighbours(blocks.chunks(v))
    K = kc.shape[2]
    dprobs = torch.einsum("bnqhp,bnkhp->bnhqk", doc, vc)
    if G:
        dprobs = torch.cat([dprobs, torch.einsum("bnqhp,bkhp->bnhqk", doc, v[:, :G])], dim=-1)
    ds = _dscores(probs, dprobs, blocks.allowed, scale)
    dq = blocks.unchunk(torch.einsum("bnhqk,bnkhe->bnqhe", ds[..., :K], kc))
    dk = blocks.unchunk(blocks.neighbours_transposed(torch.einsum("bnhqk,bnqhe->bnkhe", ds[..., :K], qc)))
    dv = blocks.unchunk(blocks.neighbours_transposed(torch.einsum("bnhqk,bnqhp->bnkhp", probs[..., :K], doc)))
    if G:
        dq = dq + blocks.unchunk(torch.einsum("bnhqk,bkhe->bnqhe", ds[..., K:], k[:, :G]))
        pad = (0, 0, 0, 0, 0, length - G)
        dk = dk + F.pad(torch.einsum("bnhqk,bnqhe->bkhe", ds[..., K:], qc), pad)
        dv = dv + F.pad(torch.einsum("bnhqk,bnqhp->bkhp", probs[..., K:], doc), pad)
        gq, gk, gv = dense(q[:, :G], dout[:, :G], row_probs, blocks.rows_allowed)
        dq = dq + F.pad(gq, pad)
        dk, dv = dk + gk, dv + gv
    return dq * scale, dk * scale, dv


@torch.library.custom_op("mixer_plugins::local_attention_blocked", mutates_args=())
def local_attention_blocked(q: Tensor, k: Tensor, v: Tensor, key_real: Optional[Tensor], window: int,
                            num_global: int, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The blocked op: q, k (B, L, H, E), v (B, L, H, P) (finite: pads already selected away), ``key_real`` (B, L)
    bool or None (False keys are excluded). Returns the output (B, L, H, P) (pad rows are not zeroed here) and the
    probabilities the backward uses (the chunks' and the global rows', see :func:`_prob_shapes`): kept, not
    recomputed, as autograd through the blocked path would (memory ``O(L * window)``)."""
    y, probs, row_probs = _blocked(q, k, v, key_real, window, num_global, causal, scale)
    return y.contiguous(), probs.contiguous(), row_probs.contiguous()


@local_attention_blocked.register_fake
def _local_attention_blocked_fake(q, k, v, key_real, window, num_global, causal, scale):
    plan = LocalPlan(q.shape[1], window, causal, num_global)
    probs, rows = _prob_shapes(q.shape, plan)
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(probs), q.new_empty(rows)


@torch.library.custom_op("mixer_plugins::local_attention_blocked_backward", mutates_args=())
def local_attention_blocked_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, key_real: Optional[Tensor],
                                     probs: Tensor, row_probs: Tensor, window: int, num_global: int, causal: bool,
                                     scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) of :func:`local_attention_blocked` from its kept probabilities."""
    dq, dk, dv = _blocked_backward(dout, q, k, v, key_real, probs, row_probs, window, num_global, causal, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@local_attention_blocked_backward.register_fake
def _local_attention_blocked_backward_fake(dout, q, k, v, key_real, probs, row_probs, window, num_global, causal,
                                           scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, key_real, window, num_global, causal, scale = inputs
    _, probs, row_probs = output
    save_tensors(ctx, q=q, k=k, v=v, key_real=key_real, probs=probs, row_probs=row_probs)
    ctx.args = (window, num_global, causal, scale)


def _backward(ctx, dout, dprobs, drow_probs):
    s = saved_tensors(ctx)
    dq, dk, dv = local_attention_blocked_backward(dout.contiguous(), s.q, s.k, s.v, s.key_real, s.probs,
                                                  s.row_probs, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


local_attention_blocked.register_autograd(_backward, setup_context=_setup)


@register_flop_formula(torch.ops.mixer_plugins.local_attention_blocked)
def _flop_formula(q_shape, k_shape, v_shape, key_real_shape, window, num_global, causal, *args, out_shape=None,
                  **kwargs) -> int:
    batch, length, heads, e = q_shape
    return sum(local_attention_flops(batch, heads, length, window, causal, e, v_shape[-1],
                                     num_global=num_global).values())


@register_flop_formula(torch.ops.mixer_plugins.local_attention_blocked_backward)
def _backward_flop_formula(dout_shape, q_shape, k_shape, v_shape, key_real_shape, probs_shape, row_probs_shape,
                           window, num_global, causal, *args, out_shape=None, **kwargs) -> int:
    # the probabilities are kept, not recomputed: dP and dV (2x the value FLOPs), dQ and dK (2x the score FLOPs)
    batch, length, heads, e = q_shape
    parts = local_attention_flops(batch, heads, length, window, causal, e, v_shape[-1], num_global=num_global)
    return 2 * parts["scores"] + 2 * parts["weighted_values"]


def local_attention_torch(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool = False,
                          mask: Tensor | None = None, scale: float, num_global: int = 0) -> Tensor:
    """The blocked path (see the module docstring); arguments as :func:`mixer_plugins.kernels.local_attention`
    (pads already selected away by it)."""
    if torch.compiler.is_exporting():
        arguments = (q, k, v, mask, int(window), int(num_global), bool(causal), float(scale))
        if isinstance(q.shape[1], torch.SymInt):  # a dynamic length axis
            return _blocked_by_index(*arguments)
        return _blocked(*arguments)[0]
    return local_attention_blocked(q, k, v, mask, int(window), int(num_global), bool(causal), float(scale))[0]
