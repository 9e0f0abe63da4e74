"""The mixer contract: :class:`MatrixMixer` (the full contract, for users and plugin authors: ``docs/contract.md``).

A mixer is four small steps, from which the base class assembles the public API (``forward``, ``materialize``,
``forward_via_matrix``, ``flops``, and decoding: ``allocate_cache``/``prefill``/``step``)::

    ctx = self.prepare(x, mask)   # projections etc.: ctx.values is (batch, length, heads, head_dim)
    y   = self.mix(ctx)           # the fast path: y_i = sum_j M_ij v_j, never building M if avoidable
    M   = self.matrix(ctx)        # the same M, materialized: (batch, heads, length, length)
    out = self.finish(ctx, y)     # gates, norms, output projection

``mask`` is an optional bool ``(batch, length)``, True on real tokens, right-padded: pad inputs are zeroed by
selection before ``prepare`` and pad outputs after ``finish``, so nothing at a pad reaches a real position.

Non-finite inputs (opt-in, ``mixer.guard_nonfinite = True``, or :func:`set_nonfinite_guard` over a model): a causal
mixer's outputs before a non-finite input token are those of the clean input, NaN from it on. It costs a pass over
the input per call, so it is off by default (the kernel libraries check shapes, not values, on the hot path).

Decoding (causal mixers with ``steppable = True``): ``prefill`` + ``step`` equal ``forward`` over the whole sequence.
A mixer implements :meth:`~MatrixMixer.init_cache`, :meth:`~MatrixMixer.fill_cache`, :meth:`~MatrixMixer.mix_step`
and, where its ``prepare`` looks across tokens, :meth:`~MatrixMixer.prepare_step` (a fused one-token path overrides
:meth:`~MatrixMixer.step_tokens`). ``prefill`` and ``step`` refuse a cache of another mixer (see
:meth:`~MatrixMixer.cache_key`) and a call autograd would record. A mixer's ``state_dict`` records its name and
options (:mod:`.records`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor, nn

from ..errors import MixerCheckpointMismatchError, SequenceLengthError
from ..layers.masks import causal_nonfinite_guard, check_mixer_input, poison_after, set_nonfinite_guard, zero_pads
from ..registry.spec import MixerConfig
from . import records
from .cache import MixerCache, StepNotSupportedError, check_cache, check_cache_request, refuse_autograd, step_with_guard
from .records import CHECKPOINT_FREE_OPTIONS, RECORD_KEY, read_mixer_record, record_differences, strip_mixer_records

mixer_record = records.mixer_record  # importable from here, as before

__all__ = [
    "CHECKPOINT_FREE_OPTIONS", "RECORD_KEY", "MatrixMixer", "MixerCheckpointMismatchError", "MixerCache",
    "MixerContext", "QKContext", "StepNotSupportedError", "check_mixer_input", "mixer_record", "read_mixer_record",
    "record_differences", "set_nonfinite_guard", "strip_mixer_records",
]


@dataclasses.dataclass(eq=False)
class MixerContext:
    """Per-call tensors shared by ``mix``, ``matrix`` and ``finish``: ``values`` (batch, length, heads, head_dim),
    ``mask``; a mixer that needs more declares a dataclass subclass (``eq=False, kw_only=True``), e.g.
    :class:`QKContext` (plain dataclasses are what ``torch.compile`` traces without graph breaks)."""

    values: Tensor
    mask: Tensor | None = None

    def __repr__(self) -> str:
        items = ", ".join(
            f"{f.name}={tuple(v.shape) if isinstance(v := getattr(self, f.name), Tensor) else v!r}"
            for f in dataclasses.fields(self)
        )
        return f"{type(self).__name__}({items})"


@dataclasses.dataclass(eq=False, kw_only=True)
class QKContext(MixerContext):
    """Context of the mixers scored by per-head queries and keys, (batch|1, length, heads, qk_dim) each."""

    q: Tensor
    k: Tensor


#: The context type a mixer's hooks pass between them (:class:`MixerContext` or a subclass).
CtxT = TypeVar("CtxT", bound=MixerContext)


class MatrixMixer(nn.Module, Generic[CtxT]):
    """Base class of every mixer in the library (and a convenient one for plugins).

    Subclasses implement :meth:`prepare`, :meth:`matrix`, :meth:`finish`, :meth:`flops` (or
    :meth:`flops_breakdown`), usually a fast :meth:`mix`, and (causal ones that decode) the decoding hooks.
    Data-independent mixers set :attr:`max_seq_len` (longer inputs raise :class:`SequenceLengthError`). A mixer whose
    context is a :class:`MixerContext` subclass derives from ``MatrixMixer[ItsContext]``.
    """

    #: True when output i depends only on inputs j <= i (a config's ``causal`` option overrides it).
    causal: bool = False
    #: Longest supported sequence for data-independent mixers; None means any length.
    max_seq_len: int | None = None
    #: Number of heads of the materialized matrix.
    num_heads: int = 1
    #: False for mixers that are not linear in their values (their ``matrix`` raises NotMaterializableError).
    materializable: bool = True
    #: True for classes that implement the decoding hooks (their causal form steps; see :attr:`can_step`).
    steppable: bool = False
    #: Opt-in: a causal mixer isolates non-finite input tokens (see the module docstring).
    guard_nonfinite: bool = False

    def __init__(self, config: MixerConfig):
        super().__init__()
        self.config = config
        self.dim = config.dim
        self.causal = bool(getattr(config, "causal", type(self).causal))
        self.register_load_state_dict_pre_hook(records.check_record_on_load)

    def get_extra_state(self) -> Tensor:
        """The mixer's record (name and options) as a uint8 tensor: the ``_extra_state`` entry of its state_dict."""
        return records.encode_record(records.mixer_record(self))

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore: the record was compared with this mixer before loading."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every parameter as a fresh build would: each child's ``reset_parameters`` (recursing into those
        without one); a mixer with parameters of its own calls ``super().reset_parameters()`` and re-draws them."""
        _reset_children(self)

    # -- what a mixer implements -------------------------------------------------------------------------------
    def prepare(self, x: Tensor, mask: Tensor | None) -> CtxT:
        """Projections etc. of a checked input: the context holding the values and what ``mix``/``matrix`` need."""
        raise NotImplementedError

    def matrix(self, ctx: CtxT) -> Tensor:
        """The L x L matrix per head, (batch, heads, length, length), applied to ``ctx.values``."""
        raise NotImplementedError

    def mix(self, ctx: CtxT) -> Tensor:
        """Apply the matrix to the values. The default builds the matrix (O(L^2)); override when faster."""
        return torch.einsum("bhij,bjhp->bihp", self.matrix(ctx), ctx.values)

    def finish(self, ctx: CtxT, y: Tensor) -> Tensor:
        """Mixed values (batch, length, heads, head_dim) -> output (batch, length, dim): gates, norms, projection."""
        raise NotImplementedError

    def flops(self, batch: int, length: int) -> int:
        """Analytic FLOPs (2 per multiply-add) of one forward at this batch and length."""
        return int(sum(self.flops_breakdown(batch, length).values()))

    def flops_breakdown(self, batch: int, length: int) -> dict[str, int]:
        """FLOPs per part (projections, scores, scan, ...). Subclasses implement this or :meth:`flops`."""
        raise NotImplementedError(f"{type(self).__name__} does not report its FLOPs")

    # -- the public API ----------------------------------------------------------------------------------------
    def check_length(self, length: int) -> None:
        """Raise :class:`SequenceLengthError` past ``max_seq_len`` (data-independent mixers)."""
        if self.max_seq_len is not None and length > self.max_seq_len:
            raise SequenceLengthError(
                f"{type(self).__name__} is data-independent: its parameters cover sequences of up to "
                f"max_seq_len={self.max_seq_len} tokens, got length {length}. Build it with a larger "
                "max_seq_len, or use the data-dependent variant (data_dependent=True) where there is one"
            )

    def _begin(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Checked input with pads zeroed by selection, the bool mask, the poisoned positions (guard on)."""
        x, mask = check_mixer_input(self, x, mask, self.dim)
        self.check_length(x.shape[1])
        x = zero_pads(x, mask)            # by selection: NaN/Inf/huge pad contents never enter the mixer
        poisoned = None
        if self.causal and self.guard_nonfinite:
            x, poisoned = causal_nonfinite_guard(x)
            if mask is not None:
                poisoned = poisoned & mask
        return x, mask, poisoned

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """``finish(prepare(x), mix(...))`` on the checked input; outputs at pads are zero."""
        x, mask, poisoned = self._begin(x, mask)
        ctx = self.prepare(x, mask)
        return zero_pads(poison_after(self.finish(ctx, self.mix(ctx)), poisoned), mask)

    def materialize(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """The mixer's matrix for this input, (batch, heads, length, length); zero on pad rows/columns."""
        x, mask, poisoned = self._begin(x, mask)
        matrix = self.matrix(self.prepare(x, mask))
        if poisoned is not None:
            matrix = matrix.masked_fill(poisoned[:, None, :, None], float("nan"))
        if mask is not None:
            matrix = matrix.masked_fill(~(mask[:, None, :, None] & mask[:, None, None, :]), 0.0)
        return matrix

    def forward_via_matrix(self, x: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """Forward computed through the materialized matrix: the oracle for :meth:`forward`."""
        x, mask, poisoned = self._begin(x, mask)
        ctx = self.prepare(x, mask)
        y = torch.einsum("bhij,bjhp->bihp", self.matrix(ctx), ctx.values)
        return zero_pads(poison_after(self.finish(ctx, y), poisoned), mask)

    # -- decoding (causal mixers that can step) ----------------------------------------------------------------
    def step_problem(self) -> str | None:
        """Why this mixer cannot step (a message), or None when it can. Subclasses add their own reasons."""
        name = getattr(self, "mixer_name", None) or type(self).__name__
        if not self.causal:
            return (f"mixer {name!r} is bidirectional (causal=False): only a causal mixer decodes token by token; "
                    "build it with causal=True where it has that option")
        if not self.steppable:
            return (f"mixer {name!r} has no decoding step (its spec says stepping=False); run forward over the whole "
                    "prefix instead")
        return None

    @property
    def can_step(self) -> bool:
        """Whether :meth:`allocate_cache`, :meth:`prefill` and :meth:`step` work on this mixer."""
        return self.step_problem() is None

    def _require_step(self) -> None:
        problem = self.step_problem()
        if problem is not None:
            raise StepNotSupportedError(problem)

    def allocate_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> MixerCache:
        """An empty decoding cache for ``batch`` rows of up to ``max_len`` tokens each (prompt and steps), owned by
        this mixer's :meth:`cache_key`. ``dtype`` (any of :data:`~mixer_plugins.mixers.cache.CACHE_DTYPES`) and
        ``device`` default to the parameters'. Raises :class:`StepNotSupportedError` for a mixer that cannot step."""
        self._require_step()
        check_cache_request(batch, max_len, dtype)
        self.check_length(max_len)
        param = next(iter(self.parameters()), None)
        if dtype is None:
            dtype = param.dtype if param is not None and param.dtype.is_floating_point else torch.get_default_dtype()
        device = torch.device(device if device is not None else
                              param.device if param is not None else torch.get_default_device())
        cache = MixerCache(lengths=torch.zeros(batch, dtype=torch.long, device=device),
                           poisoned=torch.zeros(batch, dtype=torch.bool, device=device), max_len=max_len,
                           owner=self._owner_key())
        self.init_cache(cache, batch, max_len, dtype, device)
        return cache

    def cache_key(self) -> str:
        """The owner a cache of this mixer records, which ``prefill`` and ``step`` compare: the class and the options
        that shape the state (JSON; not :data:`CHECKPOINT_FREE_OPTIONS`, nor ``max_seq_len`` of a mixer that runs at
        any length). Mixers with equal keys share caches; extend it when the state depends on more than the config."""
        free = CHECKPOINT_FREE_OPTIONS | ({"max_seq_len"} if self.max_seq_len is None else set())
        options = {k: v for k, v in records.mixer_record(self)["options"].items() if k not in free}
        return json.dumps({"class": f"{type(self).__module__}.{type(self).__qualname__}", "options": options},
                          sort_keys=True)

    def _owner_key(self) -> str:
        """:meth:`cache_key`, computed once (the per-call check is then a string comparison)."""
        if "_cache_owner_key" not in self.__dict__:
            self.__dict__["_cache_owner_key"] = self.cache_key()
        return str(self.__dict__["_cache_owner_key"])

    def _check_call(self, x: Tensor, cache: MixerCache, prefill: bool = False) -> None:
        """What ``prefill`` and ``step`` refuse before touching the cache: a cache that is not this mixer's (or cannot
        hold ``x``, or for ``prefill`` is not empty), and a call autograd would record (the cache keeps no history and
        is updated in place)."""
        check_cache(cache, x, self._owner_key(), getattr(self, "mixer_name", None), empty=prefill)
        refuse_autograd(self, x)

    def prefill(self, x: Tensor, cache: MixerCache, *, mask: Tensor | None = None) -> Tensor:
        """Run a prompt ``x`` (batch, length, dim) in one parallel pass: returns its outputs (what :meth:`forward`
        gives) and fills the empty ``cache``. With a right-padded ``mask``, each row continues from its own length."""
        self._require_step()
        x, mask, poisoned = self._begin(x, mask)
        self._check_call(x, cache, prefill=True)
        b, length = x.shape[:2]
        lengths = mask.sum(dim=1) if mask is not None else torch.full((b,), length, dtype=torch.long, device=x.device)
        ctx = self.prepare(x, mask)
        out = self.finish(ctx, self.fill_cache(cache, ctx, x, lengths))
        cache.lengths.copy_(lengths)
        if poisoned is not None:
            cache.poisoned.copy_(poisoned.any(dim=1))
        cache.offset = length
        return zero_pads(poison_after(out, poisoned), mask)

    def step(self, x: Tensor, cache: MixerCache) -> Tensor:
        """Outputs of ``t`` new tokens ``x`` (batch, t, dim) of every row, each row continuing from its own length
        in ``cache`` (updated in place). ``prefill`` + ``step`` equal :meth:`forward` over the whole sequence."""
        self._require_step()
        x, _ = check_mixer_input(self, x, None, self.dim)
        self._check_call(x, cache)
        out = step_with_guard(self.step_tokens, x, cache) if self.guard_nonfinite else self.step_tokens(x, cache)
        cache.lengths.add_(x.shape[1])
        cache.offset += x.shape[1]
        return out

    # -- the decoding hooks ------------------------------------------------------------------------------------
    def step_tokens(self, x: Tensor, cache: MixerCache) -> Tensor:
        """Outputs (batch, t, dim) of the new tokens, updating ``cache.state`` in place (:meth:`step` keeps
        ``lengths``): :meth:`prepare_step`, :meth:`mix_step`, :meth:`finish`; a fused one-token path overrides it."""
        ctx = self.prepare_step(x, cache)   # (a state of a wider dtype may widen what mix_step gives)
        return self.finish(ctx, self.mix_step(ctx, cache).to(ctx.values.dtype))

    def init_cache(self, cache: MixerCache, batch: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> None:
        """Put the mixer's zero-initialised state tensors into ``cache.state``, floating ones in ``dtype``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement init_cache")

    def fill_cache(self, cache: MixerCache, ctx: CtxT, x: Tensor, lengths: Tensor) -> Tensor:
        """Prefill: fill ``cache.state`` from the prompt's context (and its checked input ``x``; row ``b`` has
        ``lengths[b]`` real tokens) and return the mixed values :meth:`mix` gives."""
        raise NotImplementedError(f"{type(self).__name__} does not implement fill_cache")

    def prepare_step(self, x: Tensor, cache: MixerCache) -> CtxT:
        """The context of new tokens (batch, t, dim). The default is :meth:`prepare` (right for per-token
        projections); mixers whose ``prepare`` looks across tokens (a short convolution) override it."""
        return self.prepare(x, None)

    def mix_step(self, ctx: CtxT, cache: MixerCache) -> Tensor:
        """Mixed values of the new tokens (at ``cache.positions(t)``), updating ``cache.state`` in place: read it with
        ``cache.read(name, dtype)``, write through ``kv_write``/``copy_`` (which round to the cache's dtype)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement mix_step")

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.config.model_dump().items() if k != "dim")
        return f"dim={self.dim}" + (f", {opts}" if opts else "")


def _reset_children(module: nn.Module) -> None:
    for child in module.children():
        reset = getattr(child, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            _reset_children(child)
