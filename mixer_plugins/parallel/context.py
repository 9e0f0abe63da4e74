"""Context parallelism for the scan mixers: one long sequence, one contiguous segment per rank.

Rank ``r`` of a process group holds tokens ``[o_r, o_r + L_r)`` of every row (any lengths >= 1, not
necessarily equal). The mixer's block is pointwise along time except for three things, and each gets what
it needs from the other ranks:

* the short convolution (kernel ``k``) reads ``(k-1)/2`` tokens on each side (``k-1`` on the left when
  causal): every rank receives that *halo* of its neighbours' inputs (and padding mask), plus one more
  row on each side for the shift below, and runs the block's own ``prepare`` on the widened segment;
* the shifted scans (Hydra) read ``C_{i-1}`` (forward) and ``C_{i+1}`` (backward) across the segment
  border: they come from that extra halo row;
* the scans themselves: with ``a = A dt``, the part of query ``i`` in segment ``r`` that comes from the other
  segments is ``C~_i exp(q_i) H_r`` (forward; ``q_i`` the segment's sum of ``a`` up to ``i - 1`` shifted, up to
  ``i`` otherwise) and ``C~_i exp(q_i) G_r`` (backward; ``q_i`` the sum from ``i + 1`` shifted, from ``i``
  otherwise, to the segment's end), where ``H_r``/``G_r`` are the (head_dim x state) states entering the segment
  from the left/right. Each rank computes its segment's total decay ``T`` and outgoing states
  ``S = sum_j exp(a_{j+1} + ... + a_last) dt_j B_j x_j^T`` (forward) and ``R = sum_j exp(a_0 + ... + a_{j-1}) dt_j
  B_j x_j^T`` (backward); one all-gather shares them and each rank combines the prefix
  ``H_r = T_{r-1} H_{r-1} + S_{r-1}`` (and the suffix for ``G_r``). Every exponent is a sum over its own tokens,
  never a difference of two long sums, so it keeps its precision at any decay.

The segment's own part is the mixer's usual local scan, so the result equals the single-process mixer up to
floating-point rounding, outputs and gradients alike (the collectives are autograd-aware). See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from ..errors import MixerError, MixerInputError
from ..kernels import directional_scan
from ..layers.masks import zero_pads
from ..mixers.base import CtxT, check_mixer_input
from ..mixers.quasiseparable import QuasiseparableMixer, ScanContext
from ..mixers.semiseparable import SemiseparableMixer, SSDContext

__all__ = [
    "ContextParallelError",
    "ContextParallelMixer",
    "context_parallel",
    "supports_context_parallel",
    "sequence_bounds",
    "shard_sequence",
    "gather_sequence",
]


class ContextParallelError(MixerError, NotImplementedError):
    """The mixer cannot be split along the sequence (or the split was used inconsistently)."""


SUPPORTED = ("quasiseparable", "quasiseparable_no_shift", "quasiseparable_no_diag", "bidirectional_add",
             "bidirectional_mult", "bidirectional_concat", "semiseparable")


def _unsupported_reason(mixer: nn.Module) -> str | None:
    if isinstance(mixer, QuasiseparableMixer):
        if not mixer.data_dependent:
            return ("its data-independent form (data_dependent=False) holds per-position B and C parameters "
                    "indexed from the start of the sequence; use data_dependent=True")
        return None
    if isinstance(mixer, SemiseparableMixer):
        return None
    return ("only the scan mixers carry their whole past and future in a fixed-size state, which is what lets "
            "segments be combined exactly; attention-like, Toeplitz and other dense mixers would need every "
            "segment's keys/values (ring attention), which this wrapper does not implement")


def supports_context_parallel(mixer: nn.Module) -> bool:
    """Whether :func:`context_parallel` can split this mixer along the sequence."""
    return _unsupported_reason(mixer) is None


def _all_gather(t: Tensor, group: ProcessGroup | None) -> list[Tensor]:
    """Every rank's ``t`` (same shape everywhere), with gradients flowing back to the rank that sent it: the backward
    of ``torch.distributed.nn.functional.all_gather`` sums, on each sender, the gradients every rank computed for
    that sender's slot (an all-to-all on gloo, a reduce-scatter on NCCL)."""
    from torch.distributed.nn.functional import all_gather

    if dist.get_world_size(group=group) == 1:
        return [t]
    return list(all_gather(t.contiguous(), group=group))


def _all_gather_ints(values: list[int], group: ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """Every rank's list of small integers (same count everywhere); no gradients."""
    if dist.get_world_size(group=group) == 1:
        return [values]
    mine = torch.tensor(values, dtype=torch.long, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(out, mine, group=group)
    return [o.tolist() for o in out]


def sequence_bounds(length: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` segments of ``length`` tokens for ``world_size`` ranks: sizes differ by at
    most one (the first ``length % world_size`` ranks get one token more)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if length < world_size:
        raise MixerInputError(
            f"a sequence of {length} tokens cannot be split over {world_size} ranks: every rank needs at least "
            "one token"
        )
    base, extra = divmod(length, world_size)
    starts = [r * base + min(r, extra) for r in range(world_size + 1)]
    return list(zip(starts[:-1], starts[1:]))


def shard_sequence(t: Tensor, group: ProcessGroup | None = None, *, dim: int = 1) -> Tensor:
    """This rank's contiguous segment of ``t`` along ``dim`` (see :func:`sequence_bounds`)."""
    start, stop = sequence_bounds(t.shape[dim], dist.get_world_size(group=group))[dist.get_rank(group=group)]
    return t.narrow(dim, start, stop - start)


def gather_sequence(t: Tensor, group: ProcessGroup | None = None, *, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's segment (segments may differ in length); differentiable."""
    lengths = [row[0] for row in _all_gather_ints([t.shape[dim]], group, t.device)]
    longest = max(lengths)
    pad = [0, 0] * (t.dim() - 1 - (dim % t.dim())) + [0, longest - t.shape[dim]]
    parts = _all_gather(F.pad(t, pad) if longest > t.shape[dim] else t, group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths)], dim=dim)


# -- per-segment algebra ------------------------------------------------------------------------------

def _log_decay(dt: Tensor, A: Tensor, *, reverse: bool, exclusive: bool) -> Tensor:
    """Segment-local cumulative log-decay per token (b, l, h): the sum of ``a = A dt`` up to the token (from it to
    the segment's end, ``reverse``), without the token's own term when ``exclusive``. Each entry is summed over its
    own tokens (never ``p - a``, nor ``total - p``, a difference of two long sums)."""
    a = dt * A.to(dt.dtype)
    s = (a.flip(1) if reverse else a).cumsum(1)
    if exclusive:
        s = torch.cat([torch.zeros_like(s[:, :1]), s[:, :-1]], dim=1)
    return s.flip(1) if reverse else s


def _outgoing(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, *, reverse: bool) -> Tensor:
    """The state a segment sends on, ``sum_j w_j B_j x_j^T`` per head (b, h, head_dim, state): its tokens decayed to
    its end (to its start, ``reverse``). x (b, l, h, p), B (b, l, g, n) read by head h through group h // (h / g)."""
    weight = torch.exp(_log_decay(dt, A, reverse=not reverse, exclusive=True)) * dt
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    wx = (x * weight[..., None]).reshape(b, l, g, h // g, p)
    return torch.einsum("blgn,blgkp->bgkpn", B, wx).reshape(b, h, p, n)


def _incoming(C: Tensor, state: Tensor, dt: Tensor, A: Tensor, *, shift: bool, reverse: bool) -> Tensor:
    """This segment's outputs (b, l, h, p) from the state entering it (from the left, or the right when
    ``reverse``): ``exp(log_decay_i) C_i . state`` per head."""
    b, l, g, n = C.shape
    h, p = state.shape[1], state.shape[2]
    y = torch.einsum("blgn,bgkpn->blgkp", C, state.reshape(b, g, h // g, p, n)).reshape(b, l, h, p)
    return y * torch.exp(_log_decay(dt, A, reverse=reverse, exclusive=shift))[..., None]


def _recomputed(fn: Callable[..., Tensor], *args: Tensor, **options: Any) -> Tensor:
    """``fn(*args, **options)`` whose backward recomputes it instead of keeping its intermediates.

    The boundary terms (decays, weights, einsums) would otherwise save tensors the size of the scan's inputs per
    direction; their inputs are kept alive by the scan anyway, so recomputing costs a few passes in the backward and
    no memory."""
    fn = functools.partial(fn, **options)
    if not torch.is_grad_enabled() or not any(a.requires_grad for a in args):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def _entering(totals: Sequence[Tensor], states: Sequence[Tensor], rank: int, *, reverse: bool) -> Tensor:
    """State entering segment ``rank``: ``H = T_k H + S_k`` for k < rank (``reverse``: for k > rank, right to
    left). It starts from zeros that depend on the gathered states: every rank's loss must reach the all-gather, or
    the ranks whose result does not use it (the first rank of a causal scan) would skip its backward collective and
    the others would wait for them forever."""
    H = states[0] * 0
    for k in range(len(states) - 1, rank, -1) if reverse else range(rank):
        H = totals[k][..., None, None] * H + states[k]
    return H


class ContextParallelMixer(nn.Module):
    """A scan mixer run on this rank's contiguous segment of the sequence (see the module notes).

    ``forward(x_local, *, mask=None)`` takes this rank's segment (batch, L_r, dim) and, if any, its slice of
    the padding mask (bool (batch, L_r), True on real tokens; every rank passes a mask or none does), and
    returns this rank's segment of the single-process output. Every rank of ``group`` must call it
    together (it runs collectives). The parameters are the wrapped mixer's (``self.mixer``): keep them
    identical across the group (e.g. DDP/FSDP over another dimension, or all-reduce their gradients).
    """

    def __init__(self, mixer: nn.Module, group: ProcessGroup | None = None):
        super().__init__()
        reason = _unsupported_reason(mixer)
        if reason is not None:
            raise ContextParallelError(
                f"context_parallel cannot split {type(mixer).__name__} along the sequence: {reason}. "
                f"Supported mixers: {', '.join(SUPPORTED)}"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise ContextParallelError(
                "context_parallel needs an initialized torch.distributed process group "
                "(torch.distributed.init_process_group, or run under torchrun)"
            )
        assert isinstance(mixer, (QuasiseparableMixer, SemiseparableMixer)), "what _unsupported_reason accepts"
        self.mixer: QuasiseparableMixer | SemiseparableMixer = mixer
        self.group = group
        self.bidirectional = isinstance(mixer, QuasiseparableMixer)
        self.shift = bool(getattr(mixer, "shift", False)) if self.bidirectional else False
        k = mixer.conv1d.kernel_size[0] if mixer.conv1d is not None else 1
        conv_left, conv_right = (k - 1, 0) if mixer.causal_conv else ((k - 1) // 2, (k - 1) // 2)
        margin = 1 if self.shift else 0   # one more row each side: C across the border
        self.halo_left, self.halo_right = conv_left + margin, conv_right + margin

    def extra_repr(self) -> str:
        return f"world_size={dist.get_world_size(group=self.group)}, halo=({self.halo_left}, {self.halo_right})"

    # -- exchange ---------------------------------------------------------------------------------------
    def _widen(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None, int, int]:
        """This segment with its neighbours' halo rows: (x_ext, mask_ext, rows added left, rows added right)."""
        rank, world = dist.get_rank(group=self.group), dist.get_world_size(group=self.group)
        b, length, _ = x.shape
        info = _all_gather_ints([length, b, int(mask is not None), x.shape[2]], self.group, x.device)
        lengths = [row[0] for row in info]
        if any(row[1:] != info[0][1:] for row in info):
            raise MixerInputError(
                "context-parallel ranks disagree on (batch, mask given, dim): "
                + ", ".join(f"rank {r}: {tuple(row[1:])}" for r, row in enumerate(info))
            )
        width = max(self.halo_left, self.halo_right)
        if world == 1 or width == 0:
            return x, mask, 0, 0
        rows = x if mask is None else torch.cat([x, mask[..., None].to(x.dtype)], dim=-1)
        take = min(width, length)
        head = F.pad(rows[:, :take], (0, 0, 0, width - take))
        tail = F.pad(rows[:, length - take:], (0, 0, width - take, 0))
        gathered = _all_gather(torch.stack([head, tail]), self.group)

        def halo(ranks: range, need: int, from_tail: bool) -> list[Tensor]:
            """The rows of the next ranks in ``ranks`` order (each rank's tail or head), ``need`` in all."""
            parts = []
            for k in ranks:
                if need == 0:
                    break
                n = min(need, lengths[k])
                parts.append(gathered[k][1][:, width - n:] if from_tail else gathered[k][0][:, :n])
                need -= n
            return parts

        left = halo(range(rank - 1, -1, -1), self.halo_left, from_tail=True)[::-1]
        right = halo(range(rank + 1, world), self.halo_right, from_tail=False)
        n_left = sum(t.shape[1] for t in left)
        n_right = sum(t.shape[1] for t in right)
        # A rank that uses none of the gathered rows (the first rank of a causal conv) must still take part in
        # the all-gather's backward collective: tie its result to every slot with a zero.
        anchor = torch.stack(gathered).sum() * 0
        rows = torch.cat(left + [rows] + right, dim=1) + anchor
        if mask is None:
            return rows, None, n_left, n_right
        return rows[..., :-1], rows[..., -1] > 0.5, n_left, n_right

    def _combine_states(self, packed: Tensor, reverse: Sequence[bool], p: int, n: int) -> list[Tensor]:
        """The collective part of the state exchange: all-gather every rank's packed (state, total decay) per
        direction and combine the prefix (forward) or suffix (``reverse``) for this rank. Kept apart so that
        ``benchmarks/test_bench_context_parallel.py`` can time it alone at the real tensor sizes."""
        rank = dist.get_rank(group=self.group)
        gathered = _all_gather(packed, self.group)
        incoming = []
        for i, backward in enumerate(reverse):
            states = [g[i][..., :-1].unflatten(-1, (p, n)) for g in gathered]
            totals = [g[i][..., -1] for g in gathered]
            incoming.append(_entering(totals, states, rank, reverse=backward))
        return incoming

    def _cross_terms(self, x: Tensor, A: Tensor, scans: list[tuple[Tensor, Tensor, Tensor, Tensor | None]]
                     ) -> list[Tensor]:
        """This segment's outputs that come from the other segments, per scan direction ``(dt, B, C, C across the
        border or None)``, forward first, then backward: the segments' outgoing states and total decays are
        exchanged, and the state entering this segment is read through its own ``C``."""
        work = torch.promote_types(x.dtype, torch.float32)
        xs = x.to(work)
        dts = [dt.to(work) for dt, _, _, _ in scans]
        reverse = [False, True][:len(scans)]
        packed = []
        for dt, (_, B, _, _), backward in zip(dts, scans, reverse):
            state = _recomputed(_outgoing, xs, dt, A, B.to(work), reverse=backward)      # (b, h, p, n)
            total = (dt * A.to(dt.dtype)).sum(1)                                          # (b, h)
            packed.append(torch.cat([state.flatten(2), torch.exp(total)[..., None]], dim=-1))
        incoming = self._combine_states(torch.stack(packed), reverse, x.shape[-1], scans[0][1].shape[-1])
        out = []
        for dt, (_, _, C, edge), backward, state in zip(dts, scans, reverse, incoming):
            C = C.to(work)
            if self.shift:  # the shifted scan reads C one token back (forward) or ahead (backward)
                edge = torch.zeros_like(C[:, :1]) if edge is None else edge.to(work)[:, None]
                C = torch.cat([C[:, 1:], edge], dim=1) if backward else torch.cat([edge, C[:, :-1]], dim=1)
            out.append(_recomputed(_incoming, C, state, dt, A, shift=self.shift, reverse=backward).to(x.dtype))
        return out

    # -- forward ------------------------------------------------------------------------------------------
    def forward(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        mixer = self.mixer
        x, mask = check_mixer_input(mixer, x, mask, mixer.dim)
        length = x.shape[1]
        x_ext, mask_ext, n_left, n_right = self._widen(x, mask)
        ctx_ext = mixer.prepare(x_ext, mask_ext)
        # the step sizes formed once: the cross terms and the local scan read the same ones
        ctx = self._crop(ctx_ext, x_ext.shape[0], x_ext.shape[1], n_left, length).with_step_sizes()
        if isinstance(mixer, QuasiseparableMixer):
            assert isinstance(ctx_ext, ScanContext) and isinstance(ctx, ScanContext)
            prev_C = ctx_ext.C_f[:, n_left - 1] if n_left > 0 else None
            next_C = ctx_ext.C_b[:, n_left + length] if n_right > 0 else None
            cross_f, cross_b = self._cross_terms(
                ctx.x, ctx.A, [(ctx.dt_f, ctx.B_f, ctx.C_f, prev_C), (ctx.dt_b, ctx.B_b, ctx.C_b, next_C)])
            out = mixer.finish(ctx, self._mix_bidirectional(mixer, ctx, cross_f, cross_b))
        else:
            assert isinstance(ctx, SSDContext)
            (cross,) = self._cross_terms(ctx.values, ctx.A, [(ctx.dt, ctx.B, ctx.C, None)])
            out = mixer.finish(ctx, mixer.mix(ctx) + cross)
        return zero_pads(out, mask)

    @staticmethod
    def _crop(ctx: CtxT, batch: int, ext_length: int, start: int, length: int) -> CtxT:
        """The context restricted to this rank's own tokens (every per-token tensor cut along time)."""
        fields = {}
        for field in dataclasses.fields(ctx):
            value = getattr(ctx, field.name)
            if isinstance(value, Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, ext_length):
                fields[field.name] = value[:, start:start + length]
        return dataclasses.replace(ctx, **fields)

    @staticmethod
    def _mix_bidirectional(mixer: QuasiseparableMixer, ctx: ScanContext, cross_f: Tensor, cross_b: Tensor
                           ) -> Tensor:
        if mixer.combine == "sum":
            return mixer.mix(ctx) + cross_f + cross_b
        y_f = directional_scan(ctx.x, ctx.dt_f, ctx.A, ctx.B_f, ctx.C_f, shift=mixer.shift,
                               chunk_size=mixer.chunk_size) + cross_f
        y_b = directional_scan(ctx.x, ctx.dt_b, ctx.A, ctx.B_b, ctx.C_b, reverse=True, shift=mixer.shift,
                               chunk_size=mixer.chunk_size) + cross_b
        if mixer.combine == "product":
            return y_f * y_b
        return torch.cat([y_f, y_b], dim=2)


def context_parallel(mixer: nn.Module, group: ProcessGroup | None = None) -> ContextParallelMixer:
    """Wrap a scan mixer so that each rank of ``group`` (default: the world) runs its own contiguous segment
    of the sequence; the result equals the single-process mixer. Raises :class:`ContextParallelError` for
    mixers that cannot be split (attention, Toeplitz, data-independent forms, ...)."""
    return ContextParallelMixer(mixer, group)
