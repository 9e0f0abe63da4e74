"""The decoding cache of a causal mixer (:class:`MixerCache`) and the small helpers the mixers' steps share.

A causal mixer that can step (:attr:`~mixer_plugins.MatrixMixer.can_step`) keeps, between calls, what its next
outputs need: a state of fixed size (the SSD state, a linear-attention sum, a convolution tail), the keys and values
seen so far (a KV cache), or a window of them (a ring). :class:`MixerCache` holds those tensors by name, with the
bookkeeping every mixer shares:

* ``lengths`` (batch,): tokens seen by each row. Rows may differ (a right-padded prompt); a step appends the same
  number of tokens to every row, each at its own position.
* ``poisoned`` (batch,): True once a row has seen a non-finite token (its outputs are NaN from there on, as the
  mixer's forward gives).
* ``max_len``: the most tokens a row may hold (the KV caches are allocated that long); ``offset`` counts the tokens
  given so far (the padded prompt length plus the steps), a bound on every row's length known without reading a
  tensor, so a full cache is a clear error and no step reads a value to decide anything.
* ``owner``: the :meth:`~mixer_plugins.MatrixMixer.cache_key` of the mixer that allocated it (its class and the
  options that shape its state). ``prefill`` and ``step`` refuse a cache whose owner is another mixer's; mixers of the
  same class and options (a copy of the module, the same layer rebuilt) share caches.

The state tensors may be in another floating dtype than the mixer (``allocate_cache(dtype=...)``, e.g. a bfloat16 KV
cache under a float32 model): writes round to the cache's dtype (:func:`kv_write`), and a step reads the state in its
compute dtype (:meth:`MixerCache.read`).

Steps update the tensors in place (fixed addresses and shapes, what a CUDA-graph capture of ``step`` needs);
:meth:`MixerCache.reorder` (beam search) replaces them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..errors import MixerInputError, SequenceLengthError, StepNotSupportedError
from ..layers.masks import causal_nonfinite_guard, poison_after

__all__ = ["CACHE_DTYPES", "MixerCache", "StepNotSupportedError", "append_kv", "append_kv_token", "check_cache",
           "check_cache_request", "fill_kv", "init_kv", "kv_positions", "kv_write", "refuse_autograd", "ring_write",
           "step_with_guard"]

#: The dtypes a cache's state may have (``allocate_cache(dtype=...)``); any of them under a mixer of any of them.
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(eq=False)
class MixerCache:
    """What a causal mixer keeps between :meth:`~mixer_plugins.MatrixMixer.prefill` and
    :meth:`~mixer_plugins.MatrixMixer.step` calls; made by :meth:`~mixer_plugins.MatrixMixer.allocate_cache`.

    Attributes:
        lengths: (batch,) int64, tokens seen by each row.
        poisoned: (batch,) bool, True once the row has seen a non-finite token.
        max_len: the most tokens a row may hold.
        offset: tokens given so far (prompt width + steps); every row's length is at most this.
        state: the mixer's own tensors by name, each with the batch first.
        owner: the ``cache_key()`` of the mixer that allocated the cache; ``prefill`` and ``step`` of a mixer with
            another key refuse it. None for a cache made by hand (not checked).
    """

    lengths: Tensor
    poisoned: Tensor
    max_len: int
    offset: int = 0
    state: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    owner: str | None = None

    @property
    def batch(self) -> int:
        """Rows of the cache."""
        return self.lengths.shape[0]

    def positions(self, tokens: int) -> Tensor:
        """(batch, tokens) int64: the positions the next ``tokens`` tokens of each row take (for one token, a view of
        ``lengths``: read it before the step ends)."""
        if tokens == 1:
            return self.lengths.view(-1, 1)
        return self.lengths[:, None] + torch.arange(tokens, device=self.lengths.device)

    def read(self, name: str, dtype: torch.dtype) -> Tensor:
        """The state tensor ``name`` in ``dtype`` (the step's compute dtype): the tensor itself when it has that dtype
        (no copy), else a converted copy."""
        state = self.state[name]
        return state if state.dtype == dtype else state.to(dtype)

    def reorder(self, new_order: Tensor) -> None:
        """Keep the rows ``new_order`` (batch',) in that order (beam search; the batch may shrink or grow)."""
        new_order = new_order.to(self.lengths.device)
        self.lengths = self.lengths.index_select(0, new_order)
        self.poisoned = self.poisoned.index_select(0, new_order)
        self.state = {name: t.index_select(0, new_order.to(t.device)) for name, t in self.state.items()}

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors."""
        tensors = [self.lengths, self.poisoned, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.state.items())
        return f"MixerCache(batch={self.batch}, max_len={self.max_len}, offset={self.offset}, {shapes})"


def kv_positions(positions: Tensor, capacity: int) -> Tensor:
    """Bool (batch, tokens, capacity): key slot ``j`` is visible to the query at ``positions[b, i]`` (``j <= pos``)."""
    return torch.arange(capacity, device=positions.device) <= positions.unsqueeze(-1)


def kv_write(cache: Tensor, new: Tensor, positions: Tensor) -> None:
    """Write ``new`` (batch, tokens, ...) into ``cache`` (batch, capacity, ...) at ``positions`` (batch, tokens), in
    place (each row at its own positions)."""
    index = positions.view(*positions.shape, *([1] * (new.dim() - 2))).expand(new.shape)
    cache.scatter_(1, index, new if new.dtype == cache.dtype else new.to(cache.dtype))


def ring_write(ring: Tensor, new: Tensor, positions: Tensor) -> None:
    """Write ``new`` (batch, tokens, ...) into the ring ``ring`` (batch, size, ...) at slots ``positions % size``."""
    kv_write(ring, new, positions % ring.shape[1])


# -- a KV cache of every token: ``state["k"]`` (batch, max_len, heads, key width), ``state["v"]`` (..., value width) --

def init_kv(cache: MixerCache, batch: int, max_len: int, heads: int, key_width: int, value_width: int,
            dtype: torch.dtype, device: torch.device) -> None:
    """Allocate the KV cache's keys and values (zeros)."""
    cache.state["k"] = torch.zeros(batch, max_len, heads, key_width, dtype=dtype, device=device)
    cache.state["v"] = torch.zeros(batch, max_len, heads, value_width, dtype=dtype, device=device)


def fill_kv(cache: MixerCache, keys: Tensor, values: Tensor) -> None:
    """Write a prompt's keys and values (batch, length, heads, width) into the first ``length`` slots."""
    length = values.shape[1]
    cache.state["k"][:, :length] = keys.detach()
    cache.state["v"][:, :length] = values.detach()


def append_kv(cache: MixerCache, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Write a step's keys and values (batch, t, heads, width) at each row's next positions; returns those
    positions (batch, t) and the slots each of the step's queries may read (batch, t, max_len; slot ``j <=
    position``)."""
    positions = cache.positions(values.shape[1])
    kv_write(cache.state["k"], keys, positions)     # (a step records no autograd history: no detach needed)
    kv_write(cache.state["v"], values, positions)
    return positions, kv_positions(positions, cache.max_len)


def append_kv_token(cache: MixerCache, keys: Tensor, values: Tensor) -> Tensor:
    """One token per row: write its keys and values (batch, 1, heads, width) at each row's length, in place; returns
    the bool (batch, 1, 1, max_len) attention mask of the slots its query may read (``j <= length``)."""
    at = cache.lengths.view(-1, 1, 1, 1)
    for name, new in (("k", keys), ("v", values)):
        state = cache.state[name]
        state.scatter_(1, at.expand(new.shape), new if new.dtype == state.dtype else new.to(state.dtype))
    return torch.arange(cache.max_len, device=at.device) <= at


# -- what prefill and step check before touching a cache ------------------------------------------------------------

def check_cache_request(batch: object, max_len: object, dtype: torch.dtype | None) -> None:
    """``allocate_cache``'s arguments: integers ``batch >= 0``, ``max_len >= 1``, a dtype of :data:`CACHE_DTYPES`."""
    for label, value, low in (("batch", batch, 0), ("max_len", max_len, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise MixerInputError(f"allocate_cache: {label} must be an integer >= {low}, got {value!r}")
    if dtype is not None and dtype not in CACHE_DTYPES:
        raise MixerInputError(
            f"allocate_cache: dtype must be one of {', '.join(map(str, CACHE_DTYPES))} (the precision the state "
            f"is stored in), got {dtype!r}"
        )


def check_cache(cache: MixerCache, x: Tensor, owner: str, name: str | None, empty: bool = False) -> None:
    """Refuse a cache that is not a :class:`MixerCache`, belongs to another mixer (``owner`` is the caller's cache
    key, ``name`` its registry name), has other rows or another device than ``x``, cannot hold ``x``'s tokens, or
    (``empty``: a prefill) already holds some."""
    if not isinstance(cache, MixerCache):
        raise MixerInputError(f"cache must be a MixerCache (from allocate_cache), got {type(cache).__name__}")
    if cache.owner is not None and cache.owner != owner:
        raise MixerInputError(_owner_mismatch(cache.owner, owner, name))
    if cache.batch != x.shape[0]:
        raise MixerInputError(f"the cache has {cache.batch} rows but the input has batch {x.shape[0]}")
    if cache.lengths.device != x.device:
        raise MixerInputError(f"the cache is on {cache.lengths.device} but the input is on {x.device}")
    if cache.offset + x.shape[1] > cache.max_len:
        raise SequenceLengthError(
            f"the cache holds up to max_len={cache.max_len} tokens per row; {cache.offset} were given and "
            f"{x.shape[1]} more do not fit. Allocate a longer cache"
        )
    if empty and cache.offset:
        raise MixerInputError(f"prefill needs an empty cache; this one holds {cache.offset} tokens (use step to "
                              "continue it, or allocate a new one)")


def _owner_mismatch(theirs: str, ours: str, name: str | None) -> str:
    """The message refusing a cache owned by ``theirs`` (another cache key): both mixers, and the options in which
    they differ."""
    try:
        theirs_record, ours_record = json.loads(theirs), json.loads(ours)
        theirs_class, ours_class = str(theirs_record["class"]), str(ours_record["class"])
        theirs_opts, ours_opts = dict(theirs_record["options"]), dict(ours_record["options"])
    except (ValueError, KeyError, TypeError):
        theirs_desc, ours_desc = repr(theirs), repr(ours)
    else:
        theirs_short, ours_short = theirs_class.rsplit(".", 1)[-1], ours_class.rsplit(".", 1)[-1]
        missing = "(unset)"
        differ = [k for k in sorted(set(theirs_opts) | set(ours_opts))
                  if theirs_opts.get(k, missing) != ours_opts.get(k, missing)]
        if theirs_class != ours_class or not differ:
            theirs_desc, ours_desc = theirs_short, ours_short
        else:
            theirs_desc = f"{theirs_short}({', '.join(f'{k}={theirs_opts.get(k, missing)!r}' for k in differ)})"
            ours_desc = f"{ours_short}({', '.join(f'{k}={ours_opts.get(k, missing)!r}' for k in differ)})"
    return (
        f"the cache belongs to another mixer: it was allocated by {theirs_desc}, and this is {ours_desc}"
        f"{f' ({name!r})' if name else ''}. A cache holds the state of the mixer that allocated it (mixers of the "
        "same class and options share caches); allocate one with this mixer's allocate_cache"
    )


def refuse_autograd(module: nn.Module, x: Tensor) -> None:
    """Raise :class:`MixerInputError` when autograd would record a ``prefill``/``step`` of ``module`` (grad enabled,
    and the input or a parameter requires grad): the cache keeps no history and is updated in place, so gradients
    through steps would be wrong. Under ``no_grad``/``inference_mode`` this is one ``torch.is_grad_enabled()`` call."""
    if not torch.is_grad_enabled():
        return
    if not x.requires_grad and not any(p.requires_grad for p in module.parameters()):
        return  # nothing would be recorded
    culprit = "the input requires grad" if x.requires_grad else next(
        f"parameter {n!r} requires grad" for n, p in module.named_parameters() if p.requires_grad)
    raise MixerInputError(
        f"prefill and step are for inference, and autograd is recording ({culprit}): the cache keeps no autograd "
        "history and is updated in place, so gradients through the steps would be wrong. Call prefill/step under "
        "torch.no_grad() or torch.inference_mode() (to train, run forward over whole sequences)"
    )


def step_with_guard(step_tokens: Callable[[Tensor, MixerCache], Tensor], x: Tensor, cache: MixerCache) -> Tensor:
    """``step_tokens(x, cache)`` with the non-finite guard: a row's outputs are NaN from its first non-finite token
    on (``cache.poisoned`` remembers it across calls), and a non-finite token never reaches earlier ones."""
    b, t = x.shape[:2]
    if t == 1:
        # One token reaches only its own row. x - x is NaN exactly where x is not finite, so its sum flags the row.
        flag = (x - x).sum((1, 2))
        out = step_tokens(x, cache)
        poisoned = torch.logical_or(cache.poisoned, flag.ne(flag), out=cache.poisoned)
        return out.masked_fill_(poisoned.view(b, 1, 1), math.nan)
    # Several tokens are mixed together: a non-finite one is zeroed first, so it cannot reach earlier ones.
    x, bad = causal_nonfinite_guard(x)
    out = step_tokens(x, cache)
    poisoned = (bad | cache.poisoned[:, None]).cummax(dim=1).values
    cache.poisoned.copy_(poisoned[:, -1])
    return poison_after(out, poisoned)
