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

import torch
from torch import Tensor

from ..errors import StepNotSupportedError

__all__ = ["CACHE_DTYPES", "MixerCache", "StepNotSupportedError", "append_kv", "fill_kv", "init_kv", "kv_positions",
           "kv_write", "ring_write"]

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
        """(batch, tokens) int64: the positions the next ``tokens`` tokens of each row take."""
        return self.lengths[:, None] + torch.arange(tokens, device=self.lengths.device)

    def read(self, name: str, dtype: torch.dtype) -> Tensor:
        """The state tensor ``name`` in ``dtype`` (the step's compute dtype): the tensor itself when it has that dtype
        (no copy), else a converted copy."""
        return self.state[name].to(dtype)

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
    slots = torch.arange(capacity, device=positions.device)
    return slots[None, None, :] <= positions[:, :, None]


def kv_write(cache: Tensor, new: Tensor, positions: Tensor) -> None:
    """Write ``new`` (batch, tokens, ...) into ``cache`` (batch, capacity, ...) at ``positions`` (batch, tokens), in
    place (each row at its own positions)."""
    index = positions.reshape(*positions.shape, *([1] * (new.dim() - 2))).expand_as(new)
    cache.scatter_(1, index, new.to(cache.dtype))


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
    kv_write(cache.state["k"], keys.detach(), positions)
    kv_write(cache.state["v"], values.detach(), positions)
    return positions, kv_positions(positions, cache.max_len)
