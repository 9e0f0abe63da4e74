"""FLOPs of the chunked scan: what the mixers report and what ``FlopCounterMode`` counts for the scan backends."""

from __future__ import annotations

from .inputs import chunk_length

__all__ = ["chunked_scan_flops"]


def chunked_scan_flops(batch: int, length: int, heads: int, head_dim: int, groups: int, state: int,
                       directions: int, chunk_size: int, *, initial_state: bool = False, final_state: bool = False,
                       chunk_is_final: bool = False) -> int:
    """FLOPs (2 per multiply-add) of the matmul work of one chunked scan (forward pass).

    The chunks are those the scan uses (:func:`.inputs.chunk_length` tokens each, Q; with ``chunk_is_final``,
    ``chunk_size`` is that length already). Per direction: the ``C~.B`` products of each chunk (2 L Q n g), the
    intra-chunk product with x (2 L Q h p), each chunk's own state (2 L h p n) and the read-out of the entering states
    (2 L h p n), with L padded to whole chunks. A sequence that is one chunk has no states, unless the forward
    direction has an ``initial_state`` (its read-out) or returns its ``final_state`` (its chunk state).
    Elementwise work (decays, masks, the state pass between chunks) is not counted, as ``FlopCounterMode`` counts
    none.
    """
    q = chunk_size if chunk_is_final else chunk_length(length, chunk_size, heads, head_dim, state)
    padded = -(-length // q) * q
    intra = 2 * padded * q * (groups * state + heads * head_dim)
    one_pass = 2 * padded * heads * head_dim * state
    if padded == q:  # one chunk
        states = one_pass * (int(initial_state) + int(final_state))
        return batch * (directions * intra + states)
    return batch * directions * (intra + 2 * one_pass)
