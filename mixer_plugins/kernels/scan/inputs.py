"""The arguments of one scan, by name: :class:`ScanArgs` (as the public ops receive them) and :class:`ScanInputs`
(prepared: step sizes through :func:`prepare_dt`, half precision in float32), with the checks the ops share."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import check

__all__ = ["Direction", "ScanArgs", "ScanInputs", "check_generators", "check_seq_idx", "chunk_length",
           "normalize_seq_idx", "prepare_dt"]


@dataclass(frozen=True)
class Direction:
    """The generators of one scan direction: ``dt`` (b, l, h) step sizes, ``A`` (h,), ``B`` and ``C`` (b, l, g, n).

    In :class:`ScanArgs` ``dt`` is as the caller gave it; in :class:`ScanInputs` it is already through
    :func:`prepare_dt`."""

    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor


@dataclass(frozen=True)
class ScanInputs:
    """Everything one scan reads, prepared: ``x`` (b, l, h, p); the ``forward`` (lower, left to right) and/or
    ``backward`` (upper, right to left) direction, ``dt`` already through :func:`prepare_dt`; ``diag`` (b, l, h);
    ``seq_idx`` (b, l) segment ids already normalised by :func:`normalize_seq_idx` (equal ids <=> same segment;
    tokens interact only within a segment); ``initial_state`` (b, h, p, n), the forward state before token 0;
    ``shift`` (Hydra's: each direction one step off the diagonal); ``chunk_size`` (tokens per chunk, at most)."""

    x: Tensor
    forward: Direction | None = None
    backward: Direction | None = None
    diag: Tensor | None = None
    seq_idx: Tensor | None = None
    initial_state: Tensor | None = None
    shift: bool = False
    chunk_size: int = 64

    def __post_init__(self) -> None:
        if self.forward is None and self.backward is None:
            raise ValueError("a scan needs at least one direction")
        if self.initial_state is not None and self.forward is None:
            raise ValueError("the initial state belongs to the forward direction, which is absent")

    @property
    def directions(self) -> list[Direction]:
        """The directions present, forward first."""
        return [d for d in (self.forward, self.backward) if d is not None]

    @property
    def state_size(self) -> int:
        """``n``, the state width of the generators."""
        return self.directions[0].B.shape[-1]


@dataclass(frozen=True)
class ScanArgs:
    """The arguments of one call of :func:`~mixer_plugins.kernels.ssd`, :func:`~mixer_plugins.kernels.quasiseparable`
    or :func:`~mixer_plugins.kernels.directional_scan`, checked, as every backend of the ``scan`` op receives them.

    ``forward`` / ``backward``: the directions (raw ``dt``); ``dt_bias``, ``dt_softplus``, ``dt_limit`` say how
    ``dt`` becomes a step size (:func:`prepare_dt`, the same for both directions); ``A_is_log``: each direction's
    ``A`` holds ``A_log`` and the decay rates are ``-exp(A_log)``, formed in the compute dtype (float32 for half
    precision; inside the kernels on the ``triton`` backend, :meth:`with_rates` for backends that take ``A``).
    ``D`` (h,) or (h, p) and ``z`` (b, l, h, p) are SSD's skip and ``silu(z)`` gate, applied after the scan;
    ``return_final_state``: also return the forward direction's state after the last token."""

    x: Tensor
    forward: Direction | None = None
    backward: Direction | None = None
    diag: Tensor | None = None
    seq_idx: Tensor | None = None
    initial_state: Tensor | None = None
    shift: bool = False
    chunk_size: int = 64
    dt_bias: Tensor | None = None
    dt_softplus: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    D: Tensor | None = None
    z: Tensor | None = None
    return_final_state: bool = False
    A_is_log: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of ``x`` (what the backends' checks look at)."""
        return self.x.dtype

    @property
    def directions(self) -> list[Direction]:
        return [d for d in (self.forward, self.backward) if d is not None]

    def prepare(self) -> ScanInputs:
        """The scan our own backends run: ``dt`` through :func:`prepare_dt`, half-precision tensors in float32, a
        per-head skip ``D`` (h,) folded into the diagonal (:meth:`finish` then leaves it out)."""
        compute = torch.float32 if self.x.dtype in (torch.float16, torch.bfloat16) else self.x.dtype

        def up(t: Tensor) -> Tensor:
            return t.to(compute)

        def up_optional(t: Tensor | None) -> Tensor | None:
            return None if t is None else up(t)

        def prepared(d: Direction | None) -> Direction | None:
            if d is None:
                return None
            dt = prepare_dt(d.dt, self.dt_bias, self.dt_softplus, self.dt_limit)
            return Direction(dt=dt.to(compute), A=self._rate(d.A, compute), B=up(d.B), C=up(d.C))

        diag = up_optional(self.skip_as_diag(self.diag))
        return ScanInputs(x=up(self.x), forward=prepared(self.forward), backward=prepared(self.backward), diag=diag,
                          seq_idx=self.seq_idx, initial_state=up_optional(self.initial_state), shift=self.shift,
                          chunk_size=self.chunk_size)

    def _rate(self, A: Tensor, dtype: torch.dtype) -> Tensor:
        """A direction's decay rates in ``dtype``: ``A`` itself, or ``-exp(A_log)`` when :attr:`A_is_log`."""
        return -torch.exp(A.to(dtype)) if self.A_is_log else A.to(dtype)

    def with_rates(self) -> ScanArgs:
        """These arguments with ``A`` in every direction (``-exp(A_log)`` in float32 or wider when
        :attr:`A_is_log`; one tensor for a log both directions share), for backends that take ``A`` itself."""
        if not self.A_is_log:
            return self
        dtype = torch.float32 if self.x.dtype in (torch.float16, torch.bfloat16) else self.x.dtype
        rates: dict[int, Tensor] = {}

        def formed(d: Direction | None) -> Direction | None:
            if d is None:
                return None
            if id(d.A) not in rates:
                rates[id(d.A)] = self._rate(d.A, dtype)
            return dataclasses.replace(d, A=rates[id(d.A)])

        return dataclasses.replace(self, forward=formed(self.forward), backward=formed(self.backward),
                                   A_is_log=False)

    def skip_as_diag(self, diag: Tensor | None) -> Tensor | None:
        """``diag`` with a per-head skip ``D`` (h,) added: the scan then adds ``D x`` in place (a view, no copy)."""
        if self.D is None or self.D.dim() != 1:
            return diag
        skip = self.D.to(diag.dtype if diag is not None else self.x.dtype).expand(*self.x.shape[:3])
        return skip if diag is None else diag + skip

    def finish(self, y: Tensor, final: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
        """``y`` of the scan with a per-channel skip ``D`` (h, p) added (a per-head one went into the diagonal) and
        the ``silu(z)`` gate applied, in ``x``'s dtype; with the final state when asked for."""
        if self.D is not None and self.D.dim() == 2:
            y = y + self.x.to(y.dtype) * self.D.to(y.dtype)
        if self.z is not None:
            y = y * F.silu(self.z.to(y.dtype))
        y = y.to(self.x.dtype)
        if not self.return_final_state:
            return y
        assert final is not None
        return y, final

    def run_prepared(self, scan: Callable[..., Tensor | tuple[Tensor, Tensor]]) -> Tensor | tuple[Tensor, Tensor]:
        """``scan(inputs, return_final_state=...)`` on :meth:`prepare`'s inputs, then :meth:`finish` (what the
        ``reference`` and ``torch`` backends run)."""
        inputs = self.prepare()
        if self.return_final_state:
            y, final = scan(inputs, return_final_state=True)
            return self.finish(y, final)
        y = scan(inputs)
        assert isinstance(y, Tensor), "a scan without return_final_state returns its output alone"
        return self.finish(y, None)

#: Scans whose per-token state, heads x head_dim x state, holds fewer elements than this use ``chunk_size`` as given
#: (so tests at small shapes exercise the chunk boundaries they ask for); larger ones are chunked by
#: :func:`chunk_length`'s rules.
AUTO_CHUNK_MIN_STATE = 4096

#: A tuned scan no longer than ``chunk_size + ONE_CHUNK_STATES * state`` tokens runs as one chunk, with no state work
#: at all. Per token, chunks of Q tokens cost about ``(2 Q + 8 N)`` multiply-adds per head dimension forward and
#: backward (the masked intra-chunk products, half of each zero, and six state products of N), one chunk of L tokens
#: ``2 L``: the two meet at L = Q + 4 N.
ONE_CHUNK_STATES = 4


def chunk_length(length: int, chunk_size: int, heads: int, head_dim: int, state: int) -> int:
    """Tokens per chunk that a scan of ``length`` tokens with the requested ``chunk_size`` uses: the ``torch`` and
    ``native`` backends, the choice of the Triton one-chunk kernels, and the FLOP count ask this function (the Triton
    chunked kernels take chunks of at most 64 tokens, ``ScanGeometry``). It changes speed only, never the result (up
    to rounding).

    A sequence no longer than ``chunk_size`` is one chunk of ``length`` tokens. Scans of at least
    :data:`AUTO_CHUNK_MIN_STATE` state elements per token are tuned: up to ``chunk_size + ONE_CHUNK_STATES * state``
    tokens run as one chunk (a ViT's 197 tokens), longer sequences in **balanced** chunks (the fewest chunks of at
    most ``chunk_size`` tokens, all of one length: 197 tokens at chunk 64 would be 4 chunks of 50, not 256 padded).
    """
    q = max(1, min(int(chunk_size), int(length)))
    if length <= q or heads * head_dim * state < AUTO_CHUNK_MIN_STATE:
        return q
    if length <= chunk_size + ONE_CHUNK_STATES * state:
        return int(length)
    return -(-length // -(-length // q))


def check_generators(name: str, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> tuple[int, ...]:
    """Check the shapes of a scan's x and generators; returns (batch, length, heads, head_dim, groups, state)."""
    check(isinstance(x, Tensor) and x.dim() == 4,
          f"{name}: x must be a (batch, length, heads, head_dim) tensor, got "
          f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    b, l, h, p = x.shape
    check(tuple(dt.shape) == (b, l, h), f"{name}: dt must be (batch, length, heads) = {(b, l, h)}, "
                                        f"got {tuple(dt.shape)}")
    check(tuple(A.shape) == (h,), f"{name}: A must be (heads,) = ({h},), got {tuple(A.shape)}")
    check(B.dim() == 4 and B.shape[:2] == (b, l), f"{name}: B must be (batch, length, groups, state), "
                                                 f"got {tuple(B.shape)}")
    check(C.shape == B.shape, f"{name}: C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    g, n = B.shape[2], B.shape[3]
    check(g > 0 and h % g == 0, f"{name}: heads ({h}) must be a multiple of groups ({g})")
    for label, t in (("dt", dt), ("A", A), ("B", B), ("C", C)):
        check(t.is_floating_point(), f"{name}: {label} must be a floating-point tensor, got {t.dtype}")
        check(t.device == x.device, f"{name}: {label} is on {t.device}, x on {x.device}")
    check(x.is_floating_point(), f"{name}: x must be a floating-point tensor, got {x.dtype}")
    return b, l, h, p, g, n


def normalize_seq_idx(seq_idx: Tensor) -> Tensor:
    """Segment ids (b, l) -> int32 ids numbering each row's segments 0, 1, 2, ... left to right, where a new
    segment starts wherever the id changes: ``[0, 0, 1, 1, 0, 0] -> [0, 0, 1, 1, 2, 2]``. After this, equal
    ids mean the same segment, which is what every backend compares (a reused id is a new segment)."""
    change = torch.zeros(seq_idx.shape, dtype=torch.int32, device=seq_idx.device)
    if seq_idx.shape[-1] > 1:
        change[:, 1:] = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    return change.cumsum(-1, dtype=torch.int32)


def check_seq_idx(name: str, seq_idx: Tensor | None, batch: int, length: int,
                  device: torch.device | None = None) -> Tensor | None:
    """Check ``seq_idx`` (an integer (batch, length) tensor, on ``device`` when given) and return it normalised by
    :func:`normalize_seq_idx` (``None`` stays ``None``). Each public scan op calls this once, before choosing a
    backend, so every backend sees the same segments."""
    if seq_idx is None:
        return None
    check(isinstance(seq_idx, Tensor) and tuple(seq_idx.shape) == (batch, length)
          and not seq_idx.is_floating_point() and not seq_idx.is_complex(),
          f"{name}: seq_idx must be an integer (batch, length) = {(batch, length)} tensor, got "
          f"{tuple(seq_idx.shape) if isinstance(seq_idx, Tensor) else type(seq_idx).__name__} "
          f"{getattr(seq_idx, 'dtype', '')}")
    check(device is None or seq_idx.device == device,
          f"{name}: seq_idx is on {seq_idx.device}, the inputs on {device}")
    return normalize_seq_idx(seq_idx)


def prepare_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool,
               dt_limit: tuple[float, float]) -> Tensor:
    """Step sizes as the scan uses them: ``clamp(softplus?(dt + dt_bias), *dt_limit)`` in float32 or wider."""
    if dt.dtype in (torch.float16, torch.bfloat16):
        dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt
